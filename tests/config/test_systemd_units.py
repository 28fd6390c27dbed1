"""The systemd units pass ``systemd-analyze verify``; the example config file loads.

``verify`` insists that ExecStart's binary exists and that every unit named in a
dependency can be loaded, so the units are copied into a temporary directory with
``/usr/local/bin/expeditor`` pointed at this environment's ``expeditor`` script (or
the Python interpreter), the worker template is instantiated as
``expeditor-worker@0.service``, and that directory is put first on
``$SYSTEMD_UNIT_PATH`` (the trailing ``:`` keeps the system's own units, such as
``multi-user.target``, findable).

Only output about our own units counts: ``verify`` also loads the distribution's units
(``sysinit.target``, ``basic.target``, ...) and, depending on the host, may warn about
them or about the environment (a container without systemd as PID 1, a missing
``/run/systemd``); those lines are ignored. Unknown or misspelt directives in our
files only produce a warning and exit status 0, so the output is checked as well as
the status.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support.paths import REPO

from shared.config import FIELD_HELP, SCHEDULER_FIELDS, SchedulerConfig, load_config
from shared.server_config import load_server_config

SYSTEMD_DIR = REPO / "systemd"
INSTALLED_BINARY = "/usr/local/bin/expeditor"
SCHEDULER_UNIT = "expeditor-scheduler.service"
WORKER_TEMPLATE = "expeditor-worker@.service"
WORKER_INSTANCE = "expeditor-worker@0.service"
GATEWAY_UNIT = "expeditor-gateway.service"
TARGET_UNIT = "expeditor.target"
REPLICA_TEMPLATE = "expeditor-replica@.service"
REPLICA_INSTANCE = "expeditor-replica@1.service"
REPLICAS_TARGET = "expeditor-replicas.target"
TARGETS = (TARGET_UNIT, REPLICAS_TARGET)
EXAMPLE_CONFIG = SYSTEMD_DIR / "expeditor.toml"

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (Debian/Ubuntu: apt-get install systemd)",
)
SYSTEMCTL = shutil.which("systemctl")
needs_systemctl = pytest.mark.skipif(
    SYSTEMCTL is None, reason="systemctl not installed (Debian/Ubuntu: apt-get install systemd)"
)


def _quoted(path: str) -> str:
    return f'"{path}"' if " " in path else path


def _stand_in_command() -> str:
    """An absolute, existing executable (plus arguments) to replace the installed path."""
    script = Path(sys.executable).parent / "expeditor"
    if script.is_file() and os.access(script, os.X_OK):
        return _quoted(str(script))
    return f"{_quoted(sys.executable)} -m expeditor"


def _stage_units(directory: Path) -> list[Path]:
    """Copy the units into ``directory`` ready for ``verify``; return the files to check."""
    command = _stand_in_command()
    names = (SCHEDULER_UNIT, WORKER_TEMPLATE, GATEWAY_UNIT, REPLICA_TEMPLATE, *TARGETS)
    for name in names:
        text = (SYSTEMD_DIR / name).read_text()
        assert INSTALLED_BINARY in text or name in TARGETS, name
        (directory / name).write_text(text.replace(INSTALLED_BINARY, command))
    shutil.copyfile(directory / WORKER_TEMPLATE, directory / WORKER_INSTANCE)
    shutil.copyfile(directory / REPLICA_TEMPLATE, directory / REPLICA_INSTANCE)
    checked = (SCHEDULER_UNIT, WORKER_INSTANCE, GATEWAY_UNIT, REPLICA_INSTANCE, *TARGETS)
    return [directory / name for name in checked]


def _verify(directory: Path, units: list[Path]) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{directory}:", "SYSTEMD_LOG_COLOR": "0"}
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", *map(str, units)],
        capture_output=True,
        text=True,
        env=env,
        cwd=directory,
        timeout=120,
        check=False,
    )


_OUR_UNIT = re.compile(
    r"expeditor(-scheduler\.service|-(worker|replica)@\S*\.service|-gateway\.service"
    r"|(-replicas)?\.target)"
)


def _lines_about_our_units(result: subprocess.CompletedProcess[str]) -> list[str]:
    output = result.stdout + result.stderr
    return [line for line in output.splitlines() if _OUR_UNIT.search(line)]


@needs_systemd_analyze
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    units = _stage_units(tmp_path)
    result = _verify(tmp_path, units)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert _lines_about_our_units(result) == [], report
    assert result.returncode == 0, report


@needs_systemd_analyze
def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    """The check above is live: a misspelt directive and a missing dependency show up."""
    units = _stage_units(tmp_path)
    scheduler = tmp_path / SCHEDULER_UNIT
    scheduler.write_text(scheduler.read_text().replace("ProtectHome=yes", "ProtectHome_=yes"))
    worker = tmp_path / WORKER_INSTANCE
    worker.write_text(
        worker.read_text().replace(
            "BindsTo=expeditor-scheduler.service", "BindsTo=expeditor-scheduler-typo.service"
        )
    )
    result = _verify(tmp_path, units)
    complaints = "\n".join(_lines_about_our_units(result))
    assert "ProtectHome_" in complaints
    assert "expeditor-scheduler-typo.service" in complaints
    assert result.returncode != 0


@needs_systemctl
def test_enable_links_workers_to_the_target_and_the_scheduler(tmp_path: Path) -> None:
    """``systemctl --root`` works offline: enable as docs/deploy.md says, check the links."""
    assert SYSTEMCTL is not None
    unit_dir = tmp_path / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    for name in (SCHEDULER_UNIT, WORKER_TEMPLATE, GATEWAY_UNIT, TARGET_UNIT):
        shutil.copyfile(SYSTEMD_DIR / name, unit_dir / name)
    for units in ([TARGET_UNIT], ["expeditor-worker@1.service"]):
        subprocess.run(
            [SYSTEMCTL, f"--root={tmp_path}", "enable", *units],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    links = {
        str(path.relative_to(unit_dir)): os.readlink(path)
        for path in unit_dir.rglob("*")
        if path.is_symlink()
    }
    template = f"/etc/systemd/system/{WORKER_TEMPLATE}"
    assert links == {
        f"multi-user.target.wants/{TARGET_UNIT}": f"/etc/systemd/system/{TARGET_UNIT}",
        f"{TARGET_UNIT}.wants/{SCHEDULER_UNIT}": f"/etc/systemd/system/{SCHEDULER_UNIT}",
        f"{TARGET_UNIT}.wants/{GATEWAY_UNIT}": f"/etc/systemd/system/{GATEWAY_UNIT}",
        f"{TARGET_UNIT}.wants/expeditor-worker@0.service": template,
        f"{TARGET_UNIT}.wants/expeditor-worker@1.service": template,
        f"{SCHEDULER_UNIT}.wants/expeditor-worker@0.service": template,
        f"{SCHEDULER_UNIT}.wants/expeditor-worker@1.service": template,
    }


def _unit_settings(name: str) -> dict[str, list[str]]:
    """Directive -> values of one unit file (all sections; comments dropped)."""
    settings: dict[str, list[str]] = {}
    for line in (SYSTEMD_DIR / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_units_keep_the_daemons_able_to_share_ipc() -> None:
    """Settings that would silently break the scheduler/worker sharing are absent."""
    scheduler = _unit_settings(SCHEDULER_UNIT)
    worker = _unit_settings(WORKER_TEMPLATE)
    for settings in (scheduler, worker):
        assert settings["User"] == settings["Group"] == ["expeditor"]
        assert "DynamicUser" not in settings
        assert settings.get("RemoveIPC", ["no"]) == ["no"]
    assert scheduler["Type"] == ["notify"]
    assert scheduler["WatchdogSec"] == ["30"]
    assert scheduler["RuntimeDirectory"] == ["expeditor"]
    assert "RuntimeDirectory" not in worker  # the worker must not delete the sockets
    assert "PrivateDevices" not in worker  # would hide /dev/nvidia*
    assert "ProtectClock" not in worker  # implies DeviceAllow=, locking out the GPU
    assert "CUDA_VISIBLE_DEVICES=%i" in worker["Environment"]
    # Workers stop after the scheduler (the reverse of start order), so it can drain.
    assert worker["BindsTo"] == worker["Before"] == [SCHEDULER_UNIT]
    assert "After" not in worker
    assert scheduler["TimeoutStopSec"] == ["40"]  # shutdown_timeout_s (30) + 10 s
    # Enabled workers come back whenever the scheduler (re)starts, crash restarts included.
    assert set(worker["WantedBy"][0].split()) == {TARGET_UNIT, SCHEDULER_UNIT}


def test_replica_unit_runs_one_replica_and_drains_it() -> None:
    """One serve per instance, told which replica it is; SIGTERM reaches serve alone (it
    drains the scheduler before stopping the workers); the shared runtime directory
    outlives any one instance."""
    replica = _unit_settings(REPLICA_TEMPLATE)
    (command,) = replica["ExecStart"]
    assert command.startswith(f"{INSTALLED_BINARY} serve ") and "--replica %i" in command
    assert replica["Type"] == ["notify"] and replica["NotifyAccess"] == ["main"]
    assert replica["KillMode"] == ["mixed"] and replica["KillSignal"] == ["SIGTERM"]
    assert replica["RuntimeDirectoryPreserve"] == ["yes"]
    assert replica["ExecStopPost"] == [f"{INSTALLED_BINARY} cleanup-shm"]
    assert replica["User"] == replica["Group"] == ["expeditor"] and "DynamicUser" not in replica
    assert "PrivateDevices" not in replica and "ProtectClock" not in replica  # the GPUs
    assert replica["WantedBy"] == [REPLICAS_TARGET]


def test_scheduler_unit_removes_its_stale_swap_segment_when_stopped() -> None:
    """ExecStopPost= runs however the daemon ended (SIGKILL, OOM killer included)."""
    scheduler = _unit_settings(SCHEDULER_UNIT)
    assert scheduler["ExecStopPost"] == [f"{INSTALLED_BINARY} cleanup-shm"]
    assert "ExecStopPost" not in _unit_settings(WORKER_TEMPLATE)  # the scheduler owns it


# --------------------------------------------------------------------------- example config


def _example_document() -> dict[str, object]:
    with EXAMPLE_CONFIG.open("rb") as file:
        return tomllib.load(file)


def test_example_config_parses() -> None:
    document = _example_document()
    assert set(document) == {"server", "scheduler", "gateway"}
    assert document["server"] == {
        "model": "",
        "speculative_model": "",
        "dtype": "auto",
        "frontend": "ipc:///run/expeditor/frontend.sock",
        "worker_endpoint": "ipc:///run/expeditor/workers.sock",
        "workers": 1,
        "device": "auto",
        "cpu_threads": 0,
        "gpu_memory_utilization": 0.9,
        "cuda_graphs": True,
        "model_impl": "auto",
        "client_timeout_s": 10.0,
        "worker_timeout_s": 5.0,
        "worker_wait_s": 60.0,
        "step_timeout_s": 600.0,
        "shutdown_timeout_s": 30.0,
        "max_frame_bytes": 64 * 1024 * 1024,
        "max_prompt_bytes": 1024 * 1024,
    }


def test_example_gateway_table_loads_with_the_defaults() -> None:
    from shared.gateway_config import GatewayConfig, load_gateway_config

    assert load_gateway_config(EXAMPLE_CONFIG, env={}) == GatewayConfig()


@needs_systemd_analyze
def test_gateway_unit_is_tied_to_the_scheduler(tmp_path: Path) -> None:
    """Verified with the others above; here: it stops with the scheduler and after it
    (ordered Before= it, so the scheduler drains first), and verify notices when that tie
    names a unit that does not exist."""
    settings = _unit_settings(GATEWAY_UNIT)
    assert settings["BindsTo"] == [SCHEDULER_UNIT]
    assert settings["Before"] == [SCHEDULER_UNIT]
    assert SCHEDULER_UNIT not in " ".join(settings.get("After", []))
    assert settings["Type"] == ["notify"] and settings["WantedBy"] == [TARGET_UNIT]
    units = _stage_units(tmp_path)
    gateway = tmp_path / GATEWAY_UNIT
    gateway.write_text(
        gateway.read_text().replace(f"BindsTo={SCHEDULER_UNIT}", "BindsTo=expeditor-nope.service")
    )
    result = _verify(tmp_path, units)
    assert "expeditor-nope.service" in result.stdout + result.stderr
    assert result.returncode != 0


def test_example_scheduler_table_loads_with_the_defaults() -> None:
    assert load_config(EXAMPLE_CONFIG, env={}) == SchedulerConfig()


def test_example_server_table_loads() -> None:
    loaded = load_server_config(EXAMPLE_CONFIG, env={})
    assert loaded.frontend == "ipc:///run/expeditor/frontend.sock"


def _scheduler_section_lines() -> list[str]:
    lines = EXAMPLE_CONFIG.read_text().splitlines()
    start = lines.index("[scheduler]")
    section = []
    for line in lines[start + 1 :]:
        if line.startswith("["):
            break
        section.append(line)
    return section


@pytest.mark.parametrize("field", SCHEDULER_FIELDS)
def test_example_lists_every_scheduler_field_with_its_help(field: str) -> None:
    section = _scheduler_section_lines()
    assignment = re.compile(rf"^#?\s*{re.escape(field)}\s*=")
    matches = [index for index, line in enumerate(section) if assignment.match(line)]
    assert len(matches) == 1, f"{field}: expected exactly one (possibly commented) line"
    assert section[matches[0] - 1] == f"# {FIELD_HELP[field]}", f"{field}: help comment"


def test_num_gpu_blocks_is_left_commented_out() -> None:
    assert "num_gpu_blocks" not in _example_document()["scheduler"]  # type: ignore[operator]
