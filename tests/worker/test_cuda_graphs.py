"""gpu_worker.cuda_graphs without a GPU: bucket choice, padding (a padded decode step's
real rows, and a padded verify step's, equal the unpadded step's, on the CPU path and on
the Triton path under the interpreter), replay through the static inputs (the CUDA graph
faked by an eager re-run) for decode and verify shapes, and the fallback off CUDA. The
capture itself is checked by benchmarks/gpu_check.sh on a GPU."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from expeditor.llm import LLM
from gpu_worker.attention import choose_backend
from gpu_worker.cuda_graphs import (
    DecodeGraphs,
    bucket_for,
    graph_buckets,
    is_decode_only,
    pad_step,
)
from gpu_worker.model_runner import ModelRunner
from gpu_worker.step_inputs import StepInputs
from shared.sampling import SamplingParams
from shared.worker_settings import WorkerSettings

BLOCK = 16


@pytest.fixture(scope="module")
def checkpoint(model: Path) -> Path:
    return model  # the session's tiny llama (tests/conftest.py)


@pytest.fixture(scope="module")
def runner(checkpoint: Path) -> ModelRunner:
    settings = WorkerSettings.of(
        model=str(checkpoint), block_size=BLOCK, max_num_batched_tokens=256, num_gpu_blocks=64
    )
    return ModelRunner(settings, device=torch.device("cpu"), dtype=torch.float32)


def test_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(256)[-3:] == [224, 240, 256]
    buckets = graph_buckets(40)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 9, 16, 17, 33, 40)] == [
        1,
        4,
        8,
        16,
        16,
        32,
        40,
        40,
    ]
    assert bucket_for(41, buckets) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_buckets(0)


def _prefill(runner: ModelRunner, contexts: list[list[int]]) -> list[list[int]]:
    """Fill the cache with the contexts (each in its own blocks); their block tables."""
    tables, inputs, first = [], StepInputs(), 0
    for tokens in contexts:
        blocks = -(-(len(tokens) + 8) // BLOCK)  # room for a verify step's rows
        tables.append(list(range(first, first + blocks)))
        first += blocks
        inputs.token_ids.extend(tokens)
        inputs.starts.append(0)
        inputs.tables.append(tables[-1])
        inputs.query_start_loc.append(inputs.query_start_loc[-1] + len(tokens))
    runner.forward_only(inputs)
    return tables


def _decode_arrays(
    contexts: list[list[int]], tables: list[list[int]], rows: list[int] | None = None
) -> dict[str, np.ndarray]:
    """A step computing ``rows[s]`` new tokens (default 1: a decode) after context s."""
    rows = rows or [1] * len(contexts)
    inputs = StepInputs(
        token_ids=[7 + i + 3 * j for i, n in enumerate(rows) for j in range(n)],
        starts=[len(c) for c in contexts],
        tables=tables,
        query_start_loc=[0, *np.cumsum(rows).tolist()],
    )
    arrays = inputs.host_arrays(BLOCK)
    arrays["input_ids"] = np.asarray(inputs.token_ids, dtype=np.int64)
    return arrays


def _planned(runner: ModelRunner, arrays: dict[str, np.ndarray]) -> Any:
    return runner.attention_backend.plan(arrays, runner.kv_cache.num_blocks)


def _hidden(runner: ModelRunner, arrays: dict[str, np.ndarray]) -> torch.Tensor:
    tensors = runner.staging.to_device(arrays)
    with torch.inference_mode():
        return runner._run_model(tensors, runner.kv_cache, _planned(runner, arrays)).clone()


@pytest.mark.parametrize("triton", [False, True], ids=["cpu-path", "triton-path"])
@pytest.mark.parametrize(
    ("rows", "bucket", "per_seq"),
    [([1, 1, 1], 8, 1), ([5, 1, 3], 4, 5)],
    ids=["decode", "verify"],
)
def test_padding_rows_do_not_change_the_real_rows(
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    triton: bool,
    rows: list[int],
    bucket: int,
    per_seq: int,
) -> None:
    if triton:  # the backend a runner chooses with EXPEDITOR_FORCE_TRITON=1
        forced = {"EXPEDITOR_FORCE_TRITON": "1"}
        backend, _ = choose_backend(runner.device, runner.layout, runner.num_heads, forced)
        assert backend.name == "triton"
        monkeypatch.setattr(runner, "attention_backend", backend)
    contexts = [list(range(1, 1 + n)) for n in (5, 17, 33)]
    # A cache of zeros: the other parameter's run left the same K/V in the same slots,
    # where a write of (nearly) the same values would not show as a write.
    runner.kv_cache.kv.zero_()
    tables = _prefill(runner, contexts)
    arrays = _decode_arrays(contexts, tables, rows)
    assert is_decode_only(arrays) == (per_seq == 1)
    before = runner.kv_cache.kv.clone()
    eager = _hidden(runner, arrays)
    after_eager = runner.kv_cache.kv.clone()
    runner.kv_cache.kv.copy_(before)
    padded = pad_step(arrays, bucket, width=6, rows=per_seq)
    real = padded.pop("rows")
    tokens = bucket * per_seq
    assert padded["block_tables"].shape == (bucket, 6)
    assert padded["query_start_loc"].tolist() == list(range(0, tokens + 1, per_seq))
    # Each sequence's real rows first in its rows, in order; nothing stored for padding.
    assert real.tolist() == [s * per_seq + j for s, n in enumerate(rows) for j in range(n)]
    assert np.flatnonzero(padded["slot_mapping"] >= 0).tolist() == real.tolist()
    assert padded["seq_lens"][:3].tolist() == [
        len(c) + per_seq for c in contexts
    ]  # the real keys, plus as many as each sequence's padding rows
    replayed = _hidden(runner, padded)
    torch.testing.assert_close(replayed[torch.from_numpy(real)], eager, rtol=1e-5, atol=1e-5)
    # The same slots written (no more: padding stores nothing), with the same values.
    written = (runner.kv_cache.kv != before).flatten(-2).any(-1)  # per slot
    assert torch.equal(written, (after_eager != before).flatten(-2).any(-1))
    torch.testing.assert_close(runner.kv_cache.kv, after_eager, rtol=1e-5, atol=1e-5)


def test_pad_refuses_what_does_not_fit() -> None:
    arrays = _decode_arrays([[1, 2]] * 3, [[0]] * 3)
    with pytest.raises(ValueError, match="do not fit"):
        pad_step(arrays, 2, width=4)
    verify = _decode_arrays([[1, 2]] * 2, [[0]] * 2, rows=[3, 1])
    with pytest.raises(ValueError, match="do not fit"):
        pad_step(verify, 2, width=4, rows=2)


class _FakeGraph:
    """A CUDA graph stand-in: replay re-runs the captured forward eagerly into the
    captured output tensor, over the same static inputs."""

    replay_fn: Any = None

    def replay(self) -> None:
        self.replay_fn()


@pytest.fixture
def fake_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_replay_goes_through_the_static_inputs(runner: ModelRunner, fake_cuda_graphs: None) -> None:
    planned: list[tuple[int, int]] = []

    def forward(tensors: dict[str, torch.Tensor], schedule: object) -> torch.Tensor:
        assert schedule == "schedule-of-the-shape"
        arrays = {name: t.numpy() for name, t in tensors.items()}
        return runner._run_model(tensors, runner.kv_cache, _planned(runner, arrays))

    def plan(arrays: dict[str, np.ndarray]) -> str:
        planned.append((arrays["seq_lens"].shape[0], int(arrays["query_start_loc"][1])))
        return "schedule-of-the-shape"

    graphs = DecodeGraphs(
        forward,
        plan,
        max_num_seqs=4,
        width=6,
        device=torch.device("cpu"),
        staging=runner.staging,
        rows=(1, 5),  # decodes, and verify steps of 4 proposals
        max_tokens=12,  # no verify shape of 4 sequences (20 tokens)
    )
    graphs.capture()
    assert sorted(graphs.graphs) == [(1, 1), (1, 5), (2, 1), (2, 5), (4, 1)]
    # one schedule per shape, kept with its graph, the largest captured first
    assert planned == [(2, 5), (1, 5), (4, 1), (2, 1), (1, 1)]
    for shape, graph in graphs.graphs.items():
        static, out = graphs._inputs[shape], graphs._outputs[shape]
        schedule = graphs._schedules[shape]
        graph.replay_fn = lambda s=static, o=out, p=schedule: o.copy_(forward(s, p))

    contexts = [list(range(1, 1 + n)) for n in (9, 20, 3)]
    tables = _prefill(runner, contexts)
    steps = {  # a decode step, and verify steps (with a short prefill chunk) of 2 and 1
        (4, 1): _decode_arrays(contexts, tables),
        (2, 5): _decode_arrays(contexts[:2], tables[:2], rows=[5, 2]),
        (1, 5): _decode_arrays(contexts[2:], tables[2:], rows=[4]),
    }
    before = runner.kv_cache.kv.clone()
    for replays, (shape, arrays) in enumerate(steps.items(), start=1):
        runner.kv_cache.kv.copy_(before)
        eager = _hidden(runner, arrays)
        after = runner.kv_cache.kv.clone()
        runner.kv_cache.kv.copy_(before)
        assert graphs.shape_for(arrays) == shape
        with torch.inference_mode():
            replayed = graphs.run(arrays)
        assert replayed is not None and replayed.shape == eager.shape
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.kv_cache.kv, after, rtol=1e-5, atol=1e-5)
        assert graphs.replays == replays
    # Steps a graph does not cover run eagerly: a chunk longer than a verify step,
    # a verify step of more tokens than captured, too many sequences, a block table
    # wider than captured; and a step the backend's launches do not fit.
    chunk = _decode_arrays(contexts, tables, rows=[1, 1, 6])
    three = _decode_arrays(contexts, tables, rows=[5, 1, 1])
    five = _decode_arrays([[1, 2]] * 5, [[0]] * 5)
    wide = _decode_arrays([[1, 2]], [[0] * 7])
    assert [graphs.run(a) for a in (chunk, three, five, wide)] == [None] * 4
    graphs.runs = lambda arrays: False
    assert graphs.run(steps[4, 1]) is None
    assert graphs.replays == len(steps)


def test_off_cuda_graphs_are_skipped(checkpoint: Path) -> None:
    with LLM(checkpoint, device="cpu", cuda_graphs=True, max_model_len=64) as llm:
        assert llm.runner.graphs is None
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].samples[0].token_ids) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 4], ids=["decode", "speculative"])
def test_captured_graphs_give_the_eager_tokens(checkpoint: Path, k: int) -> None:
    """On a GPU: capture at start-up, replay for decode steps (and for prompt lookup's
    verify steps with ``k``), same greedy tokens as every step eager (float32)."""
    prompts = [[1, *range(10, 10 + n)] for n in (3, 40, 17, 5, 60)]
    prompts += [[1, *([20, 21, 22, 23] * 8)]]  # where prompt lookup proposes
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        with LLM(
            checkpoint,
            device="cuda",
            dtype=torch.float32,
            cuda_graphs=graphs,
            max_model_len=128,
            max_num_seqs=8,
            num_gpu_blocks=256,
            num_speculative_tokens=k,
            speculative_backoff=False,
        ) as llm:
            runs[graphs] = [o.samples[0].token_ids for o in llm.generate(prompts, params)]
            if graphs:
                assert llm.runner.graphs is not None
                assert llm.runner.graphs.replays > 0
                assert {rows for _, rows in llm.runner.graphs.graphs} == {1, k + 1}
    assert runs[True] == runs[False]
