"""The dependency rules between the project's packages (docs/architecture.md), checked on
every import statement of every module: top-level and inside functions, ``import x`` and
``from x import y``, relative imports resolved.

1. ``shared`` imports nothing of the project but ``shared``;
2. ``ipc`` imports only ``shared`` and ``ipc``;
3. the scheduler core (the folder ``scheduler_svc/core/``, :data:`CORE`) imports only
   ``shared``, ``ipc.schema`` and other core modules, and never ``zmq``, ``torch``,
   ``transformers``, ``triton``, ``gpu_worker``;
4. ``scheduler_svc`` never imports ``torch``, ``transformers``, ``triton`` or
   ``gpu_worker``;
5. nothing below ``expeditor`` imports ``expeditor``;
6. no cycle between the packages;
7. ``gpu_worker`` never imports ``scheduler_svc``: the two meet only in ``ipc`` (the
   wire) and in ``expeditor`` (``LLM``, which runs both in one process).

``benchmarks/`` and ``tests/`` may import anything and are not scanned.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "ipc", "scheduler_svc", "gpu_worker", "expeditor")
UNSCANNED = ("tests", "benchmarks")
CORE = "scheduler_svc.core"
"""The scheduler core: every module in this folder (a subpackage)."""
HEAVY = frozenset({"torch", "transformers", "triton"})
BELOW_EXPEDITOR = frozenset({"shared", "ipc", "scheduler_svc", "gpu_worker"})
RULE_1 = "shared imports only shared (rule 1)"
RULE_2 = "ipc imports only shared and ipc (rule 2)"
RULE_3 = "the scheduler core imports only shared, ipc.schema and the core (rule 3)"
RULE_4 = "scheduler_svc never imports torch, transformers, triton, gpu_worker (rule 4)"
RULE_5 = "nothing below expeditor imports expeditor (rule 5)"
RULE_7 = "gpu_worker never imports scheduler_svc (rule 7)"


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules(root: Path) -> dict[str, Path]:
    paths = (path for package in PACKAGES for path in (root / package).rglob("*.py"))
    return {_module_name(root, path): path for path in sorted(paths)}


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``path``; ``from p import name`` names
    the submodule ``p.name`` when the project has one, else ``p``."""
    is_package = path.name == "__init__.py"
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if not is_package:
                    package.pop()
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((node.lineno, submodule if submodule in known else base))
    return sorted(found)


def _broken_rules(module: str, target: str) -> list[str]:
    """The rules among 1-5 that importing ``target`` from ``module`` breaks."""
    source, top = module.split(".")[0], target.split(".")[0]
    broken: list[str] = []
    if source == "shared" and top in PACKAGES and top != "shared":
        broken.append(RULE_1)
    if source == "ipc" and top in PACKAGES and top not in ("shared", "ipc"):
        broken.append(RULE_2)
    if _in_core(module) and (
        top in ("zmq", "gpu_worker", *HEAVY)
        or (top in PACKAGES and top != "shared" and not _in_core(target) and target != "ipc.schema")
    ):
        broken.append(RULE_3)
    if source == "scheduler_svc" and (top in HEAVY or top == "gpu_worker"):
        broken.append(RULE_4)
    if source in BELOW_EXPEDITOR and top == "expeditor":
        broken.append(RULE_5)
    if source == "gpu_worker" and top == "scheduler_svc":
        broken.append(RULE_7)
    return broken


def _in_core(module: str) -> bool:
    return module == CORE or module.startswith(CORE + ".")


def _cycles(edges: dict[tuple[str, str], str]) -> list[str]:
    """One line per group of packages that import each other, with an import per edge."""
    imported: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        imported[source].add(target)
    reach: dict[str, set[str]] = {}
    for package in PACKAGES:
        seen: set[str] = set()
        todo = [package]
        while todo:
            for target in imported[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        reach[package] = seen
    groups: list[list[str]] = []
    for package in PACKAGES:
        group = [other for other in PACKAGES if other in reach[package] and package in reach[other]]
        if group and group not in groups:
            groups.append(group)
    return [
        f"package cycle between {', '.join(group)} (rule 6): "
        + "; ".join(
            f"{a} -> {b} ({site})" for (a, b), site in sorted(edges.items()) if {a, b} <= set(group)
        )
        for group in groups
    ]


def layering_violations(root: Path) -> list[str]:
    """Every broken rule under ``root`` (a checkout), one line each with the import's place."""
    violations = [
        f"{path.name}/: a top-level package outside the layering rules ({', '.join(PACKAGES)})"
        for path in sorted(root.iterdir())
        if (path / "__init__.py").is_file() and path.name not in (*PACKAGES, *UNSCANNED)
    ]
    modules = _project_modules(root)
    edges: dict[tuple[str, str], str] = {}
    for module, path in modules.items():
        for line, target in _imports(module, path, set(modules)):
            site = f"{path.relative_to(root).as_posix()}:{line}"
            violations += [
                f"{site}: {module} imports {target}: {rule}"
                for rule in _broken_rules(module, target)
            ]
            source, top = module.split(".")[0], target.split(".")[0]
            if top in PACKAGES and top != source:
                edges.setdefault((source, top), f"{site} imports {target}")
    return violations + _cycles(edges)


def test_the_project_keeps_the_layering_rules() -> None:
    assert any(_in_core(module) for module in _project_modules(ROOT)), "no core folder"
    violations = layering_violations(ROOT)
    assert not violations, "\n".join(violations)


CLEAN_TREE = {
    "shared/__init__.py": "from shared.config import Config\n",
    "shared/config.py": "import msgspec\n",
    "ipc/__init__.py": "",
    "ipc/schema.py": "from shared import config\n",
    "ipc/client.py": "import zmq\nfrom . import schema\nfrom .schema import Message\n",
    "scheduler_svc/__init__.py": "",
    "scheduler_svc/core/request.py": "from shared.config import Config\n",
    "scheduler_svc/core/scheduler.py": (
        "from ipc.schema import BatchPlan\nfrom . import request\nfrom .request import Sequence\n"
    ),
    "scheduler_svc/daemon.py": "import zmq\nfrom ipc.client import Client\nimport tokenizers\n",
    "gpu_worker/__init__.py": "",
    "gpu_worker/model_runner.py": "import torch\nfrom ipc.schema import BatchPlan\n",
    "expeditor/llm.py": (
        "import torch\nfrom gpu_worker.model_runner import ModelRunner\n"
        "from scheduler_svc.core.scheduler import Scheduler\n"
    ),
    "expeditor/__init__.py": "",
    "expeditor/cli.py": "def serve():\n    from expeditor.llm import LLM\n",
    "expeditor/bench/__init__.py": "",
    "expeditor/bench/run.py": "from ..cli import serve\nfrom .. import cli\n",
    "benchmarks/anything.py": "import expeditor.cli\nimport torch\n",
    "tests/test_anything.py": "import expeditor.cli\nimport torch\n",
}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checker_accepts_a_clean_tree(tmp_path: Path) -> None:
    assert layering_violations(_tree(tmp_path, CLEAN_TREE)) == []


LAZY = "def f():\n    {}\n"


@pytest.mark.parametrize(
    ("path", "text", "expected"),
    [
        (
            "shared/x.py",
            "import scheduler_svc\n",
            [
                f"shared/x.py:1: shared.x imports scheduler_svc: {RULE_1}",
                "package cycle between shared, ipc, scheduler_svc (rule 6)",
            ],
        ),
        (
            "shared/x.py",
            LAZY.format("from ipc.schema import A"),
            [
                f"shared/x.py:2: shared.x imports ipc.schema: {RULE_1}",
                "package cycle between shared, ipc (rule 6): ipc -> shared (ipc/schema.py:1 "
                "imports shared.config); shared -> ipc (shared/x.py:2 imports ipc.schema)",
            ],
        ),
        (
            "ipc/x.py",
            LAZY.format("from scheduler_svc import daemon"),
            [
                "ipc/x.py:2: ipc.x imports scheduler_svc.daemon: ipc imports only shared and ipc "
                "(rule 2)",
                "package cycle between ipc, scheduler_svc (rule 6)",
            ],
        ),
        (
            "scheduler_svc/core/queues.py",
            LAZY.format("import torch"),
            [
                f"queues.py:2: scheduler_svc.core.queues imports torch: {RULE_3}",
                f"queues.py:2: scheduler_svc.core.queues imports torch: {RULE_4}",
            ],
        ),
        (
            "scheduler_svc/core/policies.py",
            "import zmq\n",
            [f"policies.py:1: scheduler_svc.core.policies imports zmq: {RULE_3}"],
        ),
        (
            "scheduler_svc/core/kv_manager.py",
            "from .. import daemon\n",
            [
                "kv_manager.py:1: scheduler_svc.core.kv_manager imports scheduler_svc.daemon: "
                + RULE_3
            ],
        ),
        (
            "scheduler_svc/core/introspection.py",
            LAZY.format("from ipc.client import Client"),
            [f"introspection.py:2: scheduler_svc.core.introspection imports ipc.client: {RULE_3}"],
        ),
        (
            "scheduler_svc/supervisor.py",
            LAZY.format("from transformers import AutoModel"),
            [f"supervisor.py:2: scheduler_svc.supervisor imports transformers: {RULE_4}"],
        ),
        (
            "scheduler_svc/launch.py",
            LAZY.format("from gpu_worker import model_runner"),
            [f"launch.py:2: scheduler_svc.launch imports gpu_worker.model_runner: {RULE_4}"],
        ),
        (
            "gpu_worker/runner.py",
            "from scheduler_svc.core import scheduler\n",
            [f"runner.py:1: gpu_worker.runner imports scheduler_svc.core.scheduler: {RULE_7}"],
        ),
        (
            "gpu_worker/runner.py",
            LAZY.format("import expeditor.cli"),
            [
                f"runner.py:2: gpu_worker.runner imports expeditor.cli: {RULE_5}",
                "package cycle between gpu_worker, expeditor (rule 6)",
            ],
        ),
        (
            "ipc/x.py",
            "from expeditor import cli\n",
            [
                f"ipc/x.py:1: ipc.x imports expeditor.cli: {RULE_2}",
                f"ipc/x.py:1: ipc.x imports expeditor.cli: {RULE_5}",
                "package cycle between ipc, scheduler_svc, gpu_worker, expeditor (rule 6)",
            ],
        ),
        ("extras/__init__.py", "", ["extras/: a top-level package outside the layering rules"]),
    ],
)
def test_the_checker_reports_each_broken_rule(
    tmp_path: Path, path: str, text: str, expected: list[str]
) -> None:
    violations = layering_violations(_tree(tmp_path, {**CLEAN_TREE, path: text}))
    assert len(violations) == len(expected), violations
    for line, fragment in zip(violations, expected, strict=True):
        assert fragment in line, (fragment, violations)


def test_the_checker_reports_every_violation_at_once(tmp_path: Path) -> None:
    bad = {
        "shared/x.py": "import scheduler_svc\n",
        "scheduler_svc/core/queues.py": LAZY.format("import torch"),
        "ipc/x.py": "from gpu_worker.model_runner import ModelRunner\n",
    }
    violations = layering_violations(_tree(tmp_path, {**CLEAN_TREE, **bad}))
    assert [line.split(":")[0] for line in violations] == [
        "ipc/x.py",
        "scheduler_svc/core/queues.py",
        "scheduler_svc/core/queues.py",
        "shared/x.py",
        "package cycle between shared, ipc, scheduler_svc, gpu_worker (rule 6)",
    ]


def test_the_scheduler_side_loads_no_torch() -> None:
    """At run time too: importing the daemon, the CLI, the client library, the bench driver
    and the simulator loads neither torch nor transformers nor triton."""
    code = (
        "import sys\n"
        "import expeditor.cli, scheduler_svc.daemon, scheduler_svc.supervisor\n"
        "import ipc.client, expeditor.bench.run, scheduler_svc.simulator\n"
        "print(','.join(sorted(set(sys.modules) & {'torch', 'transformers', 'triton'})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.stdout.strip() == "", f"the scheduler side imported {out.stdout.strip()}"


def test_no_two_classes_share_a_name() -> None:
    """A class name means one thing across the packages (issue 9): ``Completion`` is the
    engine's and the wire's, the client's is ``ClientCompletion``."""
    defined: dict[str, list[str]] = defaultdict(list)
    for module, path in _project_modules(ROOT).items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                defined[node.name].append(module)
    assert {name: where for name, where in defined.items() if len(where) > 1} == {}


def test_no_test_module_imports_another() -> None:
    """What several test modules share lives in ``tests/support/``; a test module never
    imports another (nor conftest), so moving or deleting one breaks no other."""
    tests = ROOT / "tests"
    test_modules = {path.stem for path in tests.rglob("test_*.py")} | {"conftest"}
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or alias.name for alias in node.names]
            found += [
                f"{path.relative_to(ROOT).as_posix()}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[-1] in test_modules or name.split(".")[0] in test_modules
            ]
    assert not found, "\n".join(found)
