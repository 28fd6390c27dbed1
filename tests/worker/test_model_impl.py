"""The model implementation follows the model type, not the device: on the CUDA step path
(the Triton backend, here under the interpreter, decode steps
replayed from CUDA graphs, the graphs faked) llama, mistral, qwen2 and qwen3 run the lean
forward, the decode graphs capture the lean forward, every step reads the device once,
and the hidden states and greedy tokens equal transformers'."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_reference import Oracle
from support.runner_steps import (
    BLOCK,
    PROMPTS,
    SEQ_BLOCKS,
    STEPS,
    agrees_with,
    run_steps,
    step_runner,
)

from expeditor import LLM
from gpu_worker.lean_model import LEAN_TYPES, LeanDecoder
from gpu_worker.model_runner import ModelRunner
from shared.config import StepLimits
from shared.sampling import SamplingParams

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
MAX_NUM_SEQS = 4


class _FakeGraph:
    """A CUDA graph stand-in: what the lean forward computed during the capture, replayed
    (re-run over the same static inputs, into the same output tensor). A capture that ran
    any other forward records nothing, and its replays change nothing."""

    def __init__(self) -> None:
        self.captured: list[tuple[LeanDecoder, tuple[Any, ...], torch.Tensor]] = []

    def replay(self) -> None:
        for decoder, args, out in self.captured:
            out.copy_(_LEAN_CALL(decoder, *args))


_LEAN_CALL = LeanDecoder.__call__


@pytest.fixture
def cuda_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton path's kernels (under the interpreter) and faked CUDA graphs."""
    monkeypatch.setenv("EXPEDITOR_FORCE_TRITON", "1")

    @contextmanager
    def graph(fake: _FakeGraph, pool: object = None) -> Iterator[None]:
        def recording(decoder: LeanDecoder, *args: Any) -> torch.Tensor:
            out = _LEAN_CALL(decoder, *args)
            fake.captured.append((decoder, args, out))
            return out

        with monkeypatch.context() as patch:
            patch.setattr(LeanDecoder, "__call__", recording)
            yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def _cuda_path_runner(
    path: Path, model_impl: str, monkeypatch: pytest.MonkeyPatch, graphs: bool
) -> ModelRunner:
    """A runner set up as on CUDA: the Triton backend, and with ``graphs`` its decode
    graphs captured as the runner captures them on CUDA (same forward, same plans), every
    decode step graphed (no split-KV decodes, which need the device's SM count)."""
    runner = step_runner(path, model_impl, max_num_seqs=MAX_NUM_SEQS)
    backend = runner.attention_backend
    assert backend.name == "triton" and backend.capturable
    monkeypatch.setattr(backend, "graph_runs", lambda arrays: True)
    if graphs:  # tables as wide as the steps' (SEQ_BLOCKS), with a decode's one row
        limits = dict(block_size=BLOCK, max_num_batched_tokens=256)
        max_len = SEQ_BLOCKS * BLOCK - 1
        runner.graphs = runner.capture_graphs(
            StepLimits(max_num_seqs=MAX_NUM_SEQS, max_model_len=max_len, **limits)
        )
        assert runner.graphs.width == SEQ_BLOCKS
    return runner


def _syncs_per_step(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Filled with each executed step's reads of the device."""
    counts: list[int] = []
    execute = runner.execute

    def counted(plan: Any) -> Any:
        before = runner.staging.host_syncs
        result = execute(plan)
        counts.append(runner.staging.host_syncs - before)
        return result

    monkeypatch.setattr(runner, "execute", counted)
    return counts


@pytest.mark.parametrize("arch", LEAN_TYPES)
def test_the_cuda_path_runs_the_lean_forward(
    arch: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_oracle: Oracle,
    monkeypatch: pytest.MonkeyPatch,
    cuda_path: None,
) -> None:
    path = tiny_checkpoint(arch)
    lean = _cuda_path_runner(path, "auto", monkeypatch, graphs=True)
    assert lean.lean is not None
    assert lean.model_impl_note == f"lean (model type {arch!r})"
    graphs = lean.graphs
    assert graphs is not None and sorted(graphs.graphs) == [(1, 1), (2, 1), (4, 1)]
    for graph in graphs.graphs.values():
        # The capture ran the lean forward, once, and the graph's output is its output.
        assert isinstance(graph, _FakeGraph) and len(graph.captured) == 1
    for bucket, graph in graphs.graphs.items():
        assert graph.captured[0][2] is graphs._outputs[bucket]
    syncs = _syncs_per_step(lean, monkeypatch)
    eager: list[int] = []

    def counted(decoder: LeanDecoder, *args: Any) -> torch.Tensor:
        eager.append(args[0].shape[0])
        return _LEAN_CALL(decoder, *args)

    monkeypatch.setattr(LeanDecoder, "__call__", counted)
    lean_hidden, lean_tokens = run_steps(lean)
    # Decode steps replay a graph; the others (prefill, chunks beside decodes) run the
    # same lean forward eagerly.
    decodes = [i for i, s in enumerate(STEPS) if set(s.values()) == {1}]
    assert len(decodes) == 5 and graphs.replays == len(decodes)
    assert eager == [sum(s.values()) for i, s in enumerate(STEPS) if i not in decodes]
    assert syncs == [1] * len(STEPS)

    plain = _cuda_path_runner(path, "transformers", monkeypatch, graphs=False)
    assert plain.lean is None
    plain_hidden, plain_tokens = run_steps(plain)
    for step, (ours, theirs) in enumerate(zip(lean_hidden, plain_hidden, strict=True)):
        torch.testing.assert_close(
            ours, theirs, **TOLERANCE, msg=lambda m, s=step: f"step {s}: {m}"
        )
    assert lean_tokens == plain_tokens
    assert agrees_with(lean_tokens, hf_oracle(path, list(PROMPTS.values()), 8)), lean_tokens


def test_verify_steps_replay_their_graphs(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, cuda_path: None
) -> None:
    """Speculative decoding on the CUDA step path: prompt lookup's verify steps replay
    the graphs of k + 1 rows per sequence, and the greedy tokens equal those without
    graphs and those without speculation."""
    path = tiny_checkpoint("llama")
    prompts = [[1, *range(40, 52)] * 3, [1, *([60, 61, 62, 63] * 6)], [1, 7, 8, 9] * 4]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens: dict[tuple[int, bool], list[list[int]]] = {}
    replayed: Counter[int] = Counter()  # replays by rows per sequence
    for k, graphs in ((0, False), (4, False), (4, True)):
        limits = dict(max_model_len=96, max_num_seqs=4, num_gpu_blocks=64)
        spec = dict(num_speculative_tokens=k, speculative_backoff=False)
        with LLM(path, device="cpu", dtype=torch.float32, **limits, **spec) as llm:
            runner = llm.runner
            assert runner.attention_backend.name == "triton" and runner.lean is not None
            if graphs:  # as captured on CUDA (no split-KV decodes to rule out here)
                monkeypatch.setattr(runner.attention_backend, "graph_runs", lambda a: True)
                captured = runner.graphs = runner.capture_graphs(llm.config)
                assert {rows for _, rows in captured.graphs} == {1, 5}
                run = captured.run

                def counted(arrays: Any, run: Any = run, captured: Any = captured) -> Any:
                    shape = captured.shape_for(arrays)
                    out = run(arrays)
                    if out is not None:
                        replayed[shape[1]] += 1
                    return out

                monkeypatch.setattr(captured, "run", counted)
            outs = llm.generate(prompts, params)
            tokens[k, graphs] = [out.samples[0].token_ids for out in outs]
    assert replayed[5] > 0 and replayed[1] > 0, replayed
    assert tokens[4, True] == tokens[4, False] == tokens[0, False]
