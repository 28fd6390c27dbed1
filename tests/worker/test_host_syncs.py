"""The CUDA step path makes the host wait for the device once per decode step: reading
the sampled tokens. Everything else goes to the device in non-blocking copies.

Run here through the Triton path (``EXPEDITOR_FORCE_TRITON=1``, the kernels under the
interpreter), counting every call that would block the host on CUDA -- a read of a
device value (``tolist``, ``item``, ``cpu``, ``numpy``) or a copy of host data to the
device (``torch.tensor``) -- made by the worker's or transformers' code (the
interpreter's own bookkeeping is not a device operation).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.paths import REPO

from expeditor.llm import LLM
from shared.sampling import SamplingParams

ROOT = REPO
WATCHED = ("gpu_worker.", "transformers.", "ipc.")
BLOCKING_METHODS = ("tolist", "item", "cpu", "numpy")


@pytest.fixture(scope="module")
def checkpoint(model: Path) -> Path:
    return model  # the session's tiny llama (tests/conftest.py)


@pytest.fixture
def blocking_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts of would-block calls by the watched modules, by ``caller:method``."""
    counts: Counter[str] = Counter()

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(WATCHED):
                counts[f"{caller}:{name}"] += 1
            return original(*args, **kwargs)

        return wrapper

    for name in BLOCKING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "tensor", counted("tensor", torch.tensor))
    yield counts


def test_a_decode_step_blocks_once(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, blocking_calls: Counter[str]
) -> None:
    monkeypatch.setenv("EXPEDITOR_FORCE_TRITON", "1")
    params = [
        SamplingParams(max_tokens=6, temperature=0),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_tokens=6, temperature=1.0, top_k=5, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.5, n=2, min_tokens=4),
    ]
    with LLM(checkpoint, device="cpu", dtype=torch.float32, max_model_len=64) as llm:
        runner = llm.runner
        assert runner.lean is not None  # the lean forward, as on CUDA for a llama
        steps: list[tuple[bool, Counter[str], int]] = []
        execute, apply = runner.execute, runner.state.apply
        kinds: list[bool] = []

        def watched_apply(plan: Any, drafter: Any = None) -> Any:
            batch = apply(plan, drafter)
            kinds.append(bool(batch) and all(item.num_tokens == 1 for item in batch))
            return batch

        def watched_execute(plan: Any) -> Any:
            blocking_calls.clear()
            syncs = runner.staging.host_syncs
            result = execute(plan)
            steps.append((kinds[-1], Counter(blocking_calls), runner.staging.host_syncs - syncs))
            return result

        monkeypatch.setattr(runner.state, "apply", watched_apply)
        monkeypatch.setattr(runner, "execute", watched_execute)
        outs = llm.generate([[1, 5, 9, 14, 20], [1, 7], [1, 30, 31], [1, 2, 3, 4]], params)
    assert all(len(sample.token_ids) == 6 for out in outs for sample in out.samples)
    decodes = [(calls, syncs) for decode, calls, syncs in steps if decode]
    assert len(decodes) >= 4
    for calls, syncs in decodes:
        assert syncs == 1
        # The one blocking call is the staging's read of the tokens.
        assert calls == Counter({"gpu_worker.staging:tolist": 1}), calls


STEP_PATH = {
    "gpu_worker/model_runner.py": {
        "execute",
        "_forward",
        "_sample",
        "_rows",
        "_sample_rows",
        "_prepare_inputs",
        "_run_model",
    },
    "gpu_worker/step_inputs.py": None,
    "gpu_worker/kernels/attention_schedule.py": None,
    "gpu_worker/cuda_graphs.py": {"run", "shape_for", "pad_step", "is_decode_only", "bucket_for"},
    "gpu_worker/lean_model.py": {"__call__", "rotary", "_row_parallel"},
    "gpu_worker/sampler.py": None,  # every function
    "gpu_worker/attention/__init__.py": {"attend"},
    "gpu_worker/decoder.py": {"expeditor_attention", "run", "run_step"},
    "gpu_worker/kernels/attention_args.py": None,
    "gpu_worker/attention/triton_backend.py": {"plan", "graph_runs", "forward"},
}


def _blocking_calls_in(path: str, functions: set[str] | None) -> list[str]:
    found: list[str] = []
    tree = ast.parse((ROOT / path).read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        if functions is not None and node.name not in functions:
            continue
        for call in ast.walk(node):
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
                continue
            attr = call.func.attr
            owner = call.func.value
            if attr in BLOCKING_METHODS or (
                attr == "tensor" and isinstance(owner, ast.Name) and owner.id == "torch"
            ):
                found.append(f"{path}:{call.lineno} {node.name}: .{attr}()")
    return found


def test_the_step_path_reads_the_device_only_through_the_staging() -> None:
    """Code paths the run above may not take (swaps, other sampler branches) are held
    to the same rule by reading their source."""
    found = [c for path, fns in STEP_PATH.items() for c in _blocking_calls_in(path, fns)]
    assert found == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_decode_step_synchronises_once(checkpoint: Path) -> None:
    """On a GPU, torch's own sync detector: one synchronising call per decode step."""
    import warnings

    with LLM(
        checkpoint, device="cuda", dtype=torch.float32, max_model_len=64, cuda_graphs=False
    ) as llm:
        runner = llm.runner
        counts: list[tuple[bool, int]] = []
        execute, apply = runner.execute, runner.state.apply
        kinds: list[bool] = []

        def watched_apply(plan: Any, drafter: Any = None) -> Any:
            batch = apply(plan, drafter)
            kinds.append(bool(batch) and all(item.num_tokens == 1 for item in batch))
            return batch

        def watched_execute(plan: Any) -> Any:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = execute(plan)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            counts.append((kinds[-1], len(syncs)))
            return result

        runner.state.apply = watched_apply  # type: ignore[method-assign]
        runner.execute = watched_execute  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=1)
        llm.generate([[1, 5, 9], [1, 7, 8, 9]], params)
    decodes = [n for decode, n in counts if decode]
    assert decodes and all(n == 1 for n in decodes), counts
