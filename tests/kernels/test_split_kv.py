"""The attention schedule (which sequences take which launch), split-KV decodes and mixed
schedules against the torch reference, and the start-up warm-up.

Kernels run under the Triton interpreter on CPU tensors (see conftest); the split is
forced on small contexts by a small partition size and a "GPU" with many SMs.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from support.attention_cases import (
    DEVICES,
    TOL,
    AttnCase,
    AttnInputs,
    make_attn_inputs,
    need_dot_dtype,
    need_triton,
    paged_attention_ref,
)

from gpu_worker.attention import choose_backend
from gpu_worker.kernels import paged_attention_triton
from gpu_worker.kernels.attention_schedule import (
    DECODE,
    KINDS,
    PREFILL,
    REDUCE,
    SPLIT,
    AttentionSchedule,
    plan_attention,
    tile_config,
)
from gpu_worker.kernels.warmup import warm_up
from gpu_worker.kv_cache import KVLayout

ATTN_MOD = importlib.import_module("gpu_worker.kernels.paged_attention")
SPLIT_MOD = importlib.import_module("gpu_worker.kernels.split_kv")
PARTITION = 64


def schedule_of(
    inp: AttnInputs, case: AttnCase, *, num_sms: int | None = 1000, partition: int = PARTITION
) -> AttentionSchedule:
    return plan_attention(
        inp.query_start_loc.cpu().numpy(),
        inp.seq_lens.cpu().numpy(),
        num_kv_heads=case.num_kv_heads,
        queries_per_kv=case.num_heads // case.num_kv_heads,
        head_dim=case.head_dim,
        block_size=case.block_size,
        num_sms=num_sms,
        device=inp.query.device,
        partition_size=partition,
    )


# ---------------------------------------------------------------- classification


def plan(
    q_lens: list[int], seq_lens: list[int], *, num_sms: int | None = 132, qpk: int = 4, **kw: int
) -> AttentionSchedule:
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    return plan_attention(
        starts,
        np.array(seq_lens),
        num_kv_heads=kw.get("kv_heads", 8),
        queries_per_kv=qpk,
        head_dim=128,
        block_size=16,
        num_sms=num_sms,
        device="cpu",
        partition_size=kw.get("partition", 512),
    )


def test_one_long_decode_splits_into_partitions() -> None:
    s = plan([1], [32768])
    assert s.split_seqs.tolist() == [0] and s.split_parts.tolist() == [64]
    assert s.decode is None and s.prefill is None and s.split is not None
    assert s.split.num_parts == 64 and s.split.part_start.tolist() == [0, 64]
    assert s.split.partials.shape == (64, 32, 128) and s.split.sums.shape == (64, 32)
    assert s.kinds == [SPLIT, REDUCE]
    # Not a multiple of the partition size: one more, partial, partition.
    assert plan([1], [32768 + 5]).split_parts.tolist() == [65]


def test_a_chunk_beside_many_decodes_gets_prefill_tiles() -> None:
    """The issue's case: a 512-token chunk beside 255 decodes. The chunk is tiled 64 rows
    (16 tokens x 4 heads) at a time, the decodes 16 rows; none splits (255 x 8 programs
    fill 132 SMs)."""
    s = plan([512] + [1] * 255, [700] + [500] * 255)
    assert s.prefill_seqs.tolist() == [0] and s.decode_seqs.tolist() == list(range(1, 256))
    assert s.prefill is not None and s.decode is not None and s.split is None
    assert s.prefill.config == tile_config(PREFILL, 4) and s.prefill.config.block_q == 16
    assert s.prefill.num_tiles == 32 and s.prefill.tile_start.tolist() == [0, 32]
    assert s.decode.config.block_m == 16 and s.decode.num_tiles == 255
    assert s.decode.tile_start.tolist() == list(range(256))
    assert s.kinds == [DECODE, PREFILL]


def test_only_the_straggler_splits() -> None:
    """One 32k decode among 255 short ones outweighs an SM's fair share: it splits, the
    others stay one program per KV head."""
    s = plan([1] * 256, [500] * 255 + [32768])
    assert s.split_seqs.tolist() == [255] and s.decode_seqs.tolist() == list(range(255))
    # Many long decodes fill the GPU by themselves: none splits.
    assert len(plan([1] * 64, [32768] * 64).split_seqs) == 0
    # Few of them do not.
    assert plan([1] * 4, [32768] * 4).split_seqs.tolist() == [0, 1, 2, 3]


def test_what_never_splits() -> None:
    assert len(plan([1], [32768], num_sms=None).split_seqs) == 0  # CPU device: no SM count
    assert len(plan([1], [32768], num_sms=0).split_seqs) == 0
    assert len(plan([1], [1536]).split_seqs) == 0  # 3 partitions: too short
    assert plan([1], [1537]).split_parts.tolist() == [4]
    s = plan([2, 40], [32768, 32768])  # chunks never split
    assert len(s.split_seqs) == 0 and s.decode_seqs.tolist() == [0]
    assert s.prefill_seqs.tolist() == [1]


def test_query_lengths_pick_the_tile() -> None:
    # GQA 4:1: a decode tile holds 4 tokens; GQA 16:1 only 1; no new tokens: no launch.
    s = plan([0, 1, 4, 5, 0], [9, 9, 9, 9, 0])
    assert s.decode_seqs.tolist() == [1, 2] and s.prefill_seqs.tolist() == [3]
    s = plan([0, 1, 2, 17], [9, 9, 9, 20], qpk=16)
    assert s.decode_seqs.tolist() == [1] and s.prefill_seqs.tolist() == [2, 3]
    assert s.prefill is not None and s.prefill.num_tiles == 1 + 5  # BLOCK_Q 4


def test_device_index_tensors_are_aligned_views_of_one_buffer() -> None:
    s = plan([1, 30, 1, 1], [40, 100, 5000, 3000], num_sms=10**6)
    assert s.split is not None and s.decode is not None and s.prefill is not None
    tensors = [s.decode.seqs, s.decode.tile_start, s.prefill.seqs, s.prefill.tile_start]
    tensors += [s.split.seqs, s.split.part_start]
    base = s.host_buffer.data_ptr()
    for t in tensors:
        assert t.dtype == torch.int32 and t.data_ptr() % 16 == 0
        assert base <= t.data_ptr() < base + s.host_buffer.nbytes
    assert s.decode.seqs.tolist() == [0] and s.prefill.tile_start.tolist() == [0, 2]
    assert s.split.seqs.tolist() == [2, 3] and s.split.part_start.tolist() == [0, 10, 16]


def test_bad_plans_raise() -> None:
    with pytest.raises(ValueError, match="partition_size"):
        plan([1], [10], partition=48)
    with pytest.raises(ValueError, match="query_start_loc"):
        plan_attention(
            np.array([0, 1]),
            np.array([3, 4]),
            num_kv_heads=1,
            queries_per_kv=1,
            head_dim=16,
            block_size=8,
            num_sms=None,
            device="cpu",
        )
    case = AttnCase(((9, 1), (12, 3)), 4, 2, 16, 8)
    inp = make_attn_inputs(case, torch.float32, "cpu")
    other = AttnCase(((9, 1), (12, 3)), 4, 1, 16, 8)
    with pytest.raises(ValueError, match="schedule"):
        paged_attention_triton(*inp.args(), schedule=schedule_of(inp, other))


# ---------------------------------------------------------------- split-KV decodes

# Decodes over 4-6 partitions of 64 keys, none a multiple of 64; GQA 4:1 and 8:2.
SPLIT_CASES = {
    "gqa_4_1_bs16": AttnCase(((257, 1), (333, 1), (200, 1)), 4, 1, 32, 16),
    "gqa_8_2_bs8": AttnCase(((300, 1), (211, 1)), 8, 2, 16, 8),
}
# Window within a partition, across a partition boundary, beyond the context; softcap.
SPLIT_WINDOW_SOFTCAP = [(None, None), (1, None), (70, None), (1000, None), (None, 1.5), (90, 1.5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "softcap"), SPLIT_WINDOW_SOFTCAP)
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_kv_matches_ref(
    name: str, window: int | None, softcap: float | None, device: str
) -> None:
    need_triton(device)
    case = SPLIT_CASES[name]
    inp = make_attn_inputs(case, torch.float32, device, seed=11)
    schedule = schedule_of(inp, case)
    assert schedule.split_seqs.tolist() == list(range(len(case.seqs)))
    assert schedule.kinds == [SPLIT, REDUCE]
    ref = paged_attention_ref(*inp.args(), window=window, softcap=softcap)
    out = paged_attention_triton(*inp.args(), window=window, softcap=softcap, schedule=schedule)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_kv_half_precision(dtype: torch.dtype, device: str) -> None:
    need_triton(device)
    need_dot_dtype(device, dtype)
    case = SPLIT_CASES["gqa_4_1_bs16"]
    inp = make_attn_inputs(case, dtype, device, seed=12)
    schedule = schedule_of(inp, case)
    assert schedule.split is not None
    atol, rtol = TOL[dtype]
    for window, softcap in [(None, None), (70, 1.5)]:
        ref = paged_attention_ref(*inp.args(), window=window, softcap=softcap)
        out = paged_attention_triton(*inp.args(), window=window, softcap=softcap, schedule=schedule)
        assert out.dtype == dtype and not out.isnan().any()
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_reads_nothing_before_the_window(device: str) -> None:
    """K/V before the window are NaN and the table entries of blocks wholly before it
    garbage: only the partitions the window reaches work, and they read neither."""
    need_triton(device)
    case, window = AttnCase(((300, 1), (250, 1)), 4, 1, 32, 16), 100
    inp = make_attn_inputs(case, torch.float32, device, seed=13)
    schedule = schedule_of(inp, case)
    assert schedule.split_parts.tolist() == [5, 4]
    ref = paged_attention_ref(*inp.args(), window=window)
    for s, (seq_len, _) in enumerate(case.seqs):
        first_seen = seq_len - window
        for j in range(first_seen):
            block = int(inp.block_tables[s, j // case.block_size])
            inp.key_cache[block, j % case.block_size] = float("nan")
            inp.value_cache[block, j % case.block_size] = float("nan")
        inp.block_tables[s, : first_seen // case.block_size] = 10**6
    out = paged_attention_triton(*inp.args(), window=window, schedule=schedule)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- mixed schedules

MIXED = AttnCase(
    ((300, 1), (45, 12), (9, 1), (21, 21), (260, 1), (70, 40), (12, 2), (10, 0)), 8, 2, 16, 8
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, 1.5), (120, None)])
def test_mixed_schedule_matches_ref(window: int | None, softcap: float | None, device: str) -> None:
    """Split decodes, decode tiles and prefill tiles in one schedule, reused by two
    "layers" (a global one, then one with the window/softcap)."""
    need_triton(device)
    inp = make_attn_inputs(MIXED, torch.float32, device, seed=14)
    schedule = schedule_of(inp, MIXED)
    assert schedule.split_seqs.tolist() == [0, 4]
    assert schedule.decode_seqs.tolist() == [2, 6]  # GQA 4:1: up to 4 tokens per tile
    assert schedule.prefill_seqs.tolist() == [1, 3, 5]
    assert schedule.kinds == list(KINDS)
    for w, cap in [(None, None), (window, softcap)]:
        ref = paged_attention_ref(*inp.args(), window=w, softcap=cap)
        out = paged_attention_triton(*inp.args(), window=w, softcap=cap, schedule=schedule)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- warm-up

KERNELS = {
    "_paged_attention_kernel": ATTN_MOD,
    "_split_kv_partial_kernel": SPLIT_MOD,
    "_split_kv_reduce_kernel": SPLIT_MOD,
}


class _Recorder:
    """Stands in for a jitted kernel: records each launch's kernel and constexprs."""

    def __init__(self, name: str, kernel: object, launches: list) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: object, **kwargs: object) -> None:
            flags = (kwargs["HAS_WINDOW"], kwargs.get("HAS_SOFTCAP"), kwargs.get("BLOCK_M"))
            self.launches.append((self.name, *flags))
            self.kernel[grid](*args, **kwargs)  # type: ignore[index]

        return launch


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    recorded: list = []
    for name, mod in KERNELS.items():
        monkeypatch.setattr(mod, name, _Recorder(name, getattr(mod, name), recorded))
    return recorded


def test_warm_up_is_a_no_op_off_triton(launches: list) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
    for env in ({}, {"EXPEDITOR_NATIVE_CPU": "0"}):
        backend, _ = choose_backend(torch.device("cpu"), layout, 8, env)
        backend.warm_up([(None, None), (4, 30.0)])
    assert launches == []


@pytest.mark.parametrize("qpk", [1, 4])
def test_warm_up_launches_every_configuration(
    qpk: int, launches: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_triton("cpu")
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16)
    # Gemma-2-like: sliding and global layers, both soft-capped (the window value and a
    # repeated kind change nothing).
    kinds = [(22, 30.0), (None, 30.0), (4096, 30.0)]
    done = warm_up(layout, num_heads=2 * qpk, device="cpu", layer_kinds=kinds)
    expected = [(kind, w, True) for w in (True, False) for kind in KINDS]
    assert done == expected
    decode_m, prefill_m = (tile_config(k, qpk).block_m for k in (DECODE, PREFILL))
    assert launches == [
        launch
        for w in (True, False)
        for launch in [
            ("_paged_attention_kernel", w, True, decode_m),
            ("_paged_attention_kernel", w, True, prefill_m),
            ("_split_kv_partial_kernel", w, True, decode_m),
            ("_split_kv_reduce_kernel", w, None, None),
        ]
    ]
