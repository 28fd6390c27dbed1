"""The scheduler side (daemon, CLI, client library, bench driver) never imports torch."""

from __future__ import annotations

import subprocess
import sys


def test_scheduler_side_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import scheduler_svc.cli, scheduler_svc.daemon, scheduler_svc.supervisor\n"
        "import ipc.client, scheduler_svc.bench.run, scheduler_svc.simulator\n"
        "heavy = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "", f"the scheduler side imported {out.stdout.strip()}"
