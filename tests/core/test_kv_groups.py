"""Tables of layer groups (``kv_groups``, :mod:`scheduler_svc.core.kv_groups`): a model
mixing windowed and full-attention layers keeps its groups' blocks side by side in one
table, the windowed groups' given back behind the window. The trace keeps every
invariant and output under chunked prefill, prefix hits, swap, recompute, n>1, aborts,
overlap and speculation while the fake worker stores every token in every group and
checks each group's keys (a windowed group's within its window; nothing written to the
null block); and the same memory holds more sequences than one table of whole blocks.
"""

from __future__ import annotations

import pytest
from support.harness import BS, check_outputs
from support.kv_cases import make_child, make_seq, prefill
from support.window_cases import TRACE, WINDOW, grow, simulate_windowed, window_config

from ipc.plan_state import WorkerStateError
from scheduler_svc.core.kv_events import apply_events, external_hash
from scheduler_svc.core.kv_groups import GroupedKVCacheManager
from scheduler_svc.simulator import DEFAULT_KV_BYTES_PER_BLOCK, SimResult, Simulation
from scheduler_svc.traces import generate_trace
from shared.config import SchedulerConfig


def config(**fields: object) -> SchedulerConfig:
    """Twice the sliding-window tests' blocks: blocks of one of two groups' layers."""
    return window_config(**{"num_gpu_blocks": 128, "num_cpu_blocks": 96, **fields})


def simulate(
    cfg: SchedulerConfig,
    groups: tuple[int, ...],
    *,
    overlap: bool = False,
    acceptance: float | None = None,
) -> SimResult:
    return simulate_windowed(cfg, overlap=overlap, acceptance=acceptance, kv_groups=groups)


@pytest.mark.parametrize("groups", [(0, WINDOW), (WINDOW, 0, WINDOW)])
@pytest.mark.parametrize(
    ("overlap", "mode"), [(False, "swap"), (True, "recompute"), (True, "swap")]
)
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_a_trace_over_layer_groups_keeps_every_invariant_and_output(
    groups: tuple[int, ...], overlap: bool, mode: str, caching: bool
) -> None:
    cfg = config(preemption_mode=mode, enable_prefix_caching=caching)
    kept = simulate(config(preemption_mode=mode, enable_prefix_caching=caching,
                           free_out_of_window_blocks=False), groups, overlap=overlap)  # fmt: skip
    slid = simulate(cfg, groups, overlap=overlap)
    assert kept.summary["released_blocks"] == 0
    assert slid.summary["released_blocks"] > 100
    assert kept.summary["preemptions"][mode] > 0  # the pool is tight for whole contexts
    # The same pool runs the trace in fewer steps, preempting less.
    assert slid.summary["steps"] < kept.summary["steps"]
    assert sum(slid.summary["preemptions"].values()) < sum(kept.summary["preemptions"].values())


@pytest.mark.parametrize("groups", [(0, WINDOW), (WINDOW, 0, WINDOW)])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_every_groups_blocks_go_to_the_host_tier_and_come_back_together(
    groups: tuple[int, ...], mode: str
) -> None:
    """Shared prefixes that do not all fit the device pool (their windowed groups'
    blocks given back first): evicted blocks of every group are kept in the host tier
    and come back on a hit; outputs exact, invariants every step, fewer prompt tokens
    computed than without the tier."""
    trace = generate_trace(
        70, seed=11, prompt_len=(20, 60), output_len=(1, 20), arrival_rate=2.0,
        n_choices=(1, 1, 2), eos_fraction=0.3, abort_fraction=0.1,
        shared_prefixes=8, shared_prefix_len=32,
    )  # fmt: skip
    computed = {}
    for tier in (0, 48):
        cfg = config(
            num_gpu_blocks=96, prefix_cache_cpu_blocks=tier, max_num_seqs=6,
            max_model_len=128, preemption_mode=mode, cache_aware_admission=bool(tier),
            prefill_tokens_per_s=500.0,  # a slow model: a copy beats recomputing a block
        )  # fmt: skip
        # A block holds one group's layers: a whole block's bytes over the groups.
        per_block = DEFAULT_KV_BYTES_PER_BLOCK // len(groups)
        sim = Simulation(
            trace, cfg, kv_bytes_per_block=per_block, verify_kv=True, check_invariants=True,
            kv_groups=groups,
        )  # fmt: skip
        check_outputs(sim, sim.run())
        kv = sim.scheduler.kv
        computed[tier] = kv.queried_tokens - kv.hit_tokens
        if tier:
            assert kv.host is not None and kv.host.hit_tokens > 0
    assert computed[48] < computed[0]


@pytest.mark.parametrize("acceptance", [0.0, 0.8])
def test_layer_groups_and_speculative_proposals(acceptance: float) -> None:
    """Rejected proposals give their tail blocks back in every group."""
    result = simulate(
        config(num_speculative_tokens=4), (0, WINDOW), overlap=True, acceptance=acceptance
    )
    assert result.summary["released_blocks"] > 100
    assert result.summary["speculation"]["proposals"] > 0


def test_the_same_memory_holds_more_sequences_than_whole_blocks() -> None:
    """Two groups of one layer each against one table of two-layer blocks: twice the
    blocks of half the bytes, and the windowed half given back."""
    whole = Simulation(TRACE, config(num_gpu_blocks=64, num_cpu_blocks=48), verify_kv=True)
    grouped = Simulation(TRACE, config(), verify_kv=True, kv_groups=(0, WINDOW))
    one, two = whole.run(), grouped.run()
    check_outputs(whole, one)
    check_outputs(grouped, two)
    assert two.summary["steps"] < one.summary["steps"]
    assert sum(two.summary["preemptions"].values()) < sum(one.summary["preemptions"].values())


def grouped_kv(num_gpu_blocks: int = 64, caching: bool = True) -> GroupedKVCacheManager:
    return GroupedKVCacheManager(
        block_size=BS,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=32,
        enable_prefix_caching=caching,
        groups=(0, 2 * BS + 2),
    )


@pytest.mark.parametrize("caching", [True, False])
def test_a_long_sequence_holds_its_context_in_full_groups_and_the_window_in_others(
    caching: bool,
) -> None:
    kv = grouped_kv(caching=caching)
    window = kv.window
    assert (kv.null_block, kv.pool.num_blocks, kv.windowed) == (63, 63, (1,))
    seq = make_seq(list(range(100, 100 + 6 * window)))
    kv.admit(seq, kv.find_prefix(seq))
    grow(kv, seq, BS)
    for _ in range(6 * window - BS):
        released = grow(kv, seq, 1)
        assert all(i % 2 == 1 for i in released)  # only the windowed group's entries
        full, windowed = seq.block_table[0::2], seq.block_table[1::2]
        assert kv.null_block not in full
        held = [i for i, b in enumerate(windowed) if b != kv.null_block]
        assert held[0] <= max(0, seq.num_computed_tokens - window + 1) // BS
        assert len(held) <= -(-window // BS) + 2
    blocks = len(seq.block_table) // 2
    assert kv.num_held(seq) == seq.num_device_blocks == blocks + len(held)
    assert seq.num_device_blocks <= blocks + 5
    kv.free(seq)
    assert kv.pool.num_free == kv.pool.num_blocks and seq.num_released == 0


def test_a_prefix_hit_takes_the_full_groups_blocks_and_the_windows() -> None:
    """A hit takes every full group's block of the prefix, and of the windowed group
    only what the window reads (the entries before come back released); those released
    and evicted do not shorten it, a windowed block the window reads does."""
    kv = grouped_kv(num_gpu_blocks=40)  # window 10: a hit of 6 blocks reads blocks 3-5
    first = make_seq(list(range(1, 26)))  # 6 full blocks and one token
    prefill(kv, first)
    assert first.num_cached_blocks == 6
    blocks = [tuple(first.block_table[2 * i : 2 * i + 2]) for i in range(6)]
    null = kv.null_block
    want = [(full, null if i < 3 else windowed) for i, (full, windowed) in enumerate(blocks)]
    assert kv.find_prefix(make_seq(list(range(1, 26)))) == want
    # The windowed group's early blocks released and evicted: the same hit.
    kv.slide(first)
    assert first.num_released == 4  # the last query is at 24: blocks 4 and 5 are read
    kv.pool.allocate(kv.pool.num_free - 1)  # all but block 3's, released last
    assert all(kv.pool.block_hash[windowed] is None for _, windowed in blocks[:3])
    assert kv.pool.block_hash[blocks[3][1]] is not None
    again = make_seq(list(range(1, 26)))
    assert kv.find_prefix(again) == want
    kv.admit(again, want)
    assert again.num_released == 3 and again.num_computed_tokens == 6 * BS
    assert again.block_table == [b for row in want for b in row]
    assert kv.num_held(again) == 6 + 3
    kv.free(again)
    # A windowed block the window reads is gone: the hit ends before it.
    kv.pool.uncache(blocks[4][1])
    assert len(kv.find_prefix(make_seq(list(range(1, 26))))) < 5


def test_copy_on_write_copies_each_groups_shared_block() -> None:
    kv = grouped_kv()
    parent = make_seq([1, 2, 3, 4, 5, 6], n=2)
    prefill(kv, parent)
    child = make_child(parent, 1)
    kv.fork(parent, child)
    shared = parent.block_table[2:4]
    assert all(kv.pool.ref_cnt[b] == 2 for b in parent.block_table)
    parent.token_ids.append(50)
    assert kv.can_append(parent, 1, reserve=kv.pool.num_free - 2)
    assert not kv.can_append(parent, 1, reserve=kv.pool.num_free - 1)
    appended, cows = kv.append(parent, 1)
    assert appended == []
    assert [(index, source) for index, source, _ in cows] == [(2, shared[0]), (3, shared[1])]
    assert parent.block_table[2:4] == [private for *_, private in cows]
    child.token_ids.append(60)
    assert kv.append(child, 1) == ([], ())  # the last holder writes in place


def test_only_the_first_groups_blocks_are_announced() -> None:
    kv = grouped_kv()
    log = kv.record_events()
    seq = make_seq(list(range(1, 14)))  # 3 full blocks
    prefill(kv, seq)
    assert len(kv.pool.cached) == 6
    index: set[tuple[str, int]] = set()
    apply_events(index, log.take())
    announced = {("GPU", external_hash(h)) for h in seq.block_hashes[:3]}
    assert index == announced
    kv.free(seq)
    kv.pool.allocate(kv.pool.num_free)  # evicts all six
    events = log.take()
    assert [e[0] for e in events] == ["removed"]
    apply_events(index, events)
    assert index == set()


def test_groups_need_two_windows() -> None:
    with pytest.raises(ValueError, match="at least two"):
        GroupedKVCacheManager(
            block_size=BS, num_gpu_blocks=8, num_cpu_blocks=0, enable_prefix_caching=True,
            groups=(WINDOW,),
        )  # fmt: skip


def test_host_hits_of_tier_blocks_numbered_like_the_null_block_are_copied() -> None:
    """Tier blocks are CPU-pool numbers: one may equal the device null block's number,
    and must still be copied, not taken for a released entry."""
    kv = GroupedKVCacheManager(
        block_size=BS, num_gpu_blocks=6, num_cpu_blocks=16, enable_prefix_caching=True,
        groups=(0, 6), num_host_blocks=16,
    )  # fmt: skip
    assert kv.host is not None and kv.null_block in kv.host.blocks
    prompts = [[100 * p + i for i in range(5)] for p in range(3)]  # a full block, a token
    for tokens in prompts:
        seq = make_seq(tokens)
        prefill(kv, seq)
        kv.free(seq)
        blocks = kv.pool.allocate(kv.pool.num_free)  # every cached block demoted
        kv.host.take_pending()
        kv.pool.release(blocks)
    for tokens in prompts:
        seq = make_seq(tokens)
        hits = kv.find_prefix(seq)
        host = kv.find_host(seq, hits)
        assert (hits, len(host)) == ([], 1)
        copies = kv.admit(seq, hits, host)
        assert [tier for tier, _ in copies] == list(host[0])  # both groups' blocks
        assert kv.null_block not in seq.block_table and seq.num_released == 0
        kv.free(seq)
        kv.host.unpin(tier for tier, _ in copies)


def test_the_host_tier_overwrites_a_block_kept_without_an_event() -> None:
    """With KV events on, the tier keeps the other groups' blocks without events, and
    overwriting one announces nothing."""
    kv = GroupedKVCacheManager(
        block_size=BS, num_gpu_blocks=16, num_cpu_blocks=8, enable_prefix_caching=True,
        groups=(0, 6), num_host_blocks=2,
    )  # fmt: skip
    log = kv.record_events()
    seq = make_seq(list(range(1, 14)))  # 3 full blocks: 6 device blocks over 2 groups
    prefill(kv, seq)
    kv.free(seq)
    index: set[tuple[str, int]] = set()
    for _ in range(kv.pool.num_free):  # one eviction a plan, the tier overwriting
        kv.pool.allocate(1)
        kv.host.take_pending()  # type: ignore[union-attr]
        apply_events(index, log.take())
        pool, host = kv.pool, kv.host
        assert host is not None
        announced = {h for h, block in pool.cached.items() if not pool.quiet[block]}
        assert index == {("GPU", external_hash(h)) for h in announced} | {
            ("CPU", external_hash(h)) for h in host.event_hash.values()
        }
    assert host.num_demoted > 2  # the tier of 2 overwrote blocks


def test_the_fake_worker_tells_the_groups_apart() -> None:
    """The check the trace tests rest on: a table whose two groups' blocks trade places
    (each still holding the right tokens, of the other group) fails the next read."""
    cfg = config(free_out_of_window_blocks=False)  # both groups keep every block
    sim = Simulation(TRACE, cfg, verify_kv=True, check_invariants=True, kv_groups=(0, WINDOW))
    swapped: list[str] = []

    def swap_groups(_: object) -> None:
        if swapped:
            return
        for seq_id, seq in sim.worker.state.seqs.items():
            if len(seq.block_ids) >= 2 and seq.num_computed_tokens >= BS:
                seq.block_ids[0], seq.block_ids[1] = seq.block_ids[1], seq.block_ids[0]
                swapped.append(seq_id)
                return

    with pytest.raises(WorkerStateError, match=r"\(group [01]\) holds token \d+ of group [01]"):
        sim.run(on_step=swap_groups)
    assert swapped
