"""Each setting the daemon, ``LLM`` and the workers share is declared once: its default
lives in its settings table, and the daemon's worker setup, ``LLM``'s engine settings,
the wire and the model runner all see that one value."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from expeditor.gateway.app import Gateway
from expeditor.gateway.server import run_gateway
from expeditor.llm import LLM, engine_settings
from gpu_worker.model_runner import ModelRunner
from ipc.schema import WorkerSetup, control_decoder, encode
from scheduler_svc.daemon import SchedulerDaemon
from shared.config import SchedulerConfig
from shared.config_fields import field_spec
from shared.server_config import ServerConfig
from shared.worker_settings import WORKER_FIELDS, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "ipc", "scheduler_svc", "gpu_worker", "expeditor")
DECLARED = {
    "cuda_graphs": ("shared/server_config.py", ServerConfig),
    "gpu_memory_utilization": ("shared/server_config.py", ServerConfig),
    "model_impl": ("shared/server_config.py", ServerConfig),
    "max_prompt_bytes": ("shared/server_config.py", ServerConfig),
    "max_num_seqs": ("shared/config.py", SchedulerConfig),
}
"""Field -> the one module that declares its default, and a table that has it."""


def _literal(node: ast.expr | None) -> bool:
    """A default written out (a constant, or arithmetic on constants), not read from
    the declaration."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    return isinstance(node, ast.UnaryOp) and _literal(node.operand)


def _literal_defaults(path: Path) -> list[tuple[str, int]]:
    """(field, line) of every literal default given to a field of DECLARED in ``path``:
    a class attribute, a parameter default or ``dict.get(name, default)``."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id in DECLARED and _literal(node.value):
                found.append((node.target.id, node.lineno))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in DECLARED:
                    if _literal(node.value):
                        found.append((target.id, node.lineno))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = list(
                zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
            )
            pairs += [
                (a, d)
                for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                if d is not None
            ]
            found += [(a.arg, a.lineno) for a, d in pairs if a.arg in DECLARED and _literal(d)]
    return found


def test_each_default_is_written_once_in_its_table() -> None:
    declared: dict[str, list[str]] = {name: [] for name in DECLARED}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, line in _literal_defaults(path):
                declared[name].append(f"{path.relative_to(ROOT)}:{line}")
    for name, (module, _table) in DECLARED.items():
        assert len(declared[name]) == 1, (name, declared[name])
        assert declared[name][0].startswith(module + ":"), (name, declared[name])


def _daemon_setup(server: ServerConfig, config: SchedulerConfig) -> WorkerSetup:
    """What SchedulerDaemon.worker_setup sends a worker before any hello (no sockets)."""
    daemon = SimpleNamespace(core=None, config=config, server=server, dist_port=0, swap_pool=None)
    return SchedulerDaemon.worker_setup(daemon)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(set(DECLARED) - {"max_prompt_bytes"}))
def test_daemon_llm_and_worker_see_the_same_default(name: str) -> None:
    _, table = DECLARED[name]
    default = field_spec(table, name).default
    # The daemon (from its [server] and [scheduler] tables) ...
    assert getattr(table(), name) == default
    sent = _daemon_setup(ServerConfig(), SchedulerConfig()).settings
    # ... what a worker decodes from the wire ...
    received = control_decoder.decode(encode(WorkerSetup(settings=sent)))
    assert isinstance(received, WorkerSetup)
    # ... LLM's engine, and a setup built with nothing given.
    llm_scheduler, llm_settings = engine_settings()
    half = "server" if table is ServerConfig else "scheduler"
    for settings in (sent, received.settings, llm_settings, WorkerSetup().settings):
        assert getattr(getattr(settings, half), name) == default
    if table is SchedulerConfig:
        assert getattr(llm_scheduler, name) == default


def test_the_worker_settings_travel_whole() -> None:
    server = ServerConfig(cuda_graphs=False, gpu_memory_utilization=0.5, model_impl="transformers")
    config = SchedulerConfig(max_num_seqs=7, block_size=8, num_cpu_blocks=4)
    sent = _daemon_setup(server, config).settings
    assert sent == WorkerSettings.of(
        cuda_graphs=False,
        gpu_memory_utilization=0.5,
        model_impl="transformers",
        max_num_seqs=7,
        block_size=8,
    )
    assert msgspec.convert(msgspec.to_builtins(sent), WorkerSettings) == sent
    # LLM's keywords reach the same struct.
    _, from_llm = engine_settings(
        cuda_graphs=False, gpu_memory_utilization=0.5, model_impl="transformers",
        max_num_seqs=7, block_size=8, num_cpu_blocks=4,
    )  # fmt: skip
    assert from_llm == sent
    assert set(WORKER_FIELDS) == set(msgspec.structs.asdict(sent.server)) | set(
        msgspec.structs.asdict(sent.scheduler)
    )


def test_no_one_else_gives_these_settings_a_default() -> None:
    """ModelRunner and LLM take the settings whole or as table fields: neither has a
    parameter of its own for them; the gateway's prompt limit is [server]'s default."""
    for function in (ModelRunner.__init__, LLM.__init__):
        assert not set(inspect.signature(function).parameters) & set(DECLARED)
    default = field_spec(ServerConfig, "max_prompt_bytes").default
    for function in (Gateway.__init__, run_gateway):
        assert inspect.signature(function).parameters["max_prompt_bytes"].default == default
