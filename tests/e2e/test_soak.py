"""A short run of the soak test (benchmarks/soak.py) against a real ``expeditor serve``:
mixed load, aborts, disconnects, bad frames, a killed worker, a 10 MB prompt and an
out-of-vocabulary token id; nothing may be lost, leaked or fail unexpectedly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

ROOT = REPO


def test_a_short_soak_loses_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "soak.py"),
            "--duration",
            "25",
            "--concurrency",
            "8",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = f"stdout:\n{run.stdout[-6000:]}\nstderr:\n{run.stderr[-3000:]}"
    assert out.exists(), log
    report = json.loads(out.read_text())
    assert "serve_error" not in report, log
    requests, frames = report["requests"], report["bad_frames"]
    assert report["scheduler"]["died"] is None, log
    assert requests["lost"] == 0, log
    assert requests["unexpected"] == 0, log
    assert requests["completed"] > 0 and requests["aborted"] > 0, log
    assert requests["sent"] == sum(
        count for outcomes in requests["by_kind"].values() for count in outcomes.values()
    )
    final = report["final_state"]
    assert final is not None and final["snapshot"], log
    assert final["leaked_gpu_blocks"] == 0 and final["leaked_cpu_blocks"] == 0, log
    assert final["requests_held"] == 0 and final["seqs"] == 0, log
    assert frames["sent"] > 0 and frames["answered"] == frames["sent"], log
    assert {"random_bytes", "truncated", "nested", "huge_string", "wrong_types"} <= set(
        frames["by_kind"]
    )
    kill = report["worker_kill"]
    assert kill is not None and kill["killed_pid"] is not None, log
    assert kill["recovered"], log
    assert report["big_prompt"]["outcome"] == "bad_request", log
    assert report["out_of_vocab"]["outcome"] == "bad_request", log
    assert report["ok"] and run.returncode == 0, log
