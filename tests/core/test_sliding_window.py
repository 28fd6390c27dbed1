"""Blocks behind every layer's sliding window given back (``kv_window``): the trace keeps
every invariant and every output under chunked prefill, prefix hits, swap, recompute,
n>1, aborts, overlap and speculation, while the fake worker checks every K/V slot the
window reads and that nothing is written to the null block; and what a long sequence
holds is the window's blocks, not its context's.
"""

from __future__ import annotations

import pytest
from support.harness import BS, Harness, checked_run
from support.kv_cases import make_seq
from support.window_cases import TRACE, WINDOW, grow, simulate_windowed, window_config

from ipc.schema import SeqStatus
from scheduler_svc.core.introspection import check_invariants
from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.simulator import SimResult, Simulation
from scheduler_svc.traces import generate_trace
from shared.config import SchedulerConfig

config = window_config


def simulate(
    cfg: SchedulerConfig, *, window: int, overlap: bool, acceptance: float | None = None
) -> SimResult:
    return simulate_windowed(cfg, overlap=overlap, acceptance=acceptance, kv_window=window)


@pytest.mark.parametrize(
    ("overlap", "mode"), [(False, "swap"), (True, "recompute"), (True, "swap")]
)
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_a_trace_with_released_blocks_keeps_every_invariant_and_output(
    overlap: bool, mode: str, caching: bool
) -> None:
    cfg = config(preemption_mode=mode, enable_prefix_caching=caching)
    whole = simulate(cfg, window=0, overlap=overlap)
    slid = simulate(cfg, window=WINDOW, overlap=overlap)
    assert slid.summary["released_blocks"] > 100
    assert whole.summary["released_blocks"] == 0
    assert whole.summary["preemptions"][mode] > 0  # the pool is tight for whole contexts
    # The same pool holds more sequences at once, and they are preempted less.
    assert slid.summary["peak_running"] >= whole.summary["peak_running"]
    assert sum(slid.summary["preemptions"].values()) < sum(whole.summary["preemptions"].values())


@pytest.mark.parametrize("acceptance", [0.0, 0.8])
def test_released_blocks_and_speculative_proposals(acceptance: float) -> None:
    """Rejected proposals give their tail blocks back, the window its head blocks."""
    cfg = config(num_speculative_tokens=4)
    result = simulate(cfg, window=WINDOW, overlap=True, acceptance=acceptance)
    assert result.summary["released_blocks"] > 100
    assert result.summary["speculation"]["proposals"] > 0


def test_the_switch_turns_release_off() -> None:
    result = simulate(config(free_out_of_window_blocks=False), window=WINDOW, overlap=False)
    assert result.summary["released_blocks"] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_a_long_sequence_holds_only_its_windows_blocks(caching: bool) -> None:
    window = 2 * BS + 2
    kv = KVCacheManager(
        block_size=BS,
        num_gpu_blocks=64,
        num_cpu_blocks=0,
        enable_prefix_caching=caching,
        window=window,
    )
    assert kv.null_block == 63 and kv.pool.num_blocks == 63
    seq = make_seq(list(range(100, 100 + 8 * window)))
    kv.admit(seq, kv.find_prefix(seq))
    grow(kv, seq, BS)
    for _ in range(8 * window - BS):
        grow(kv, seq, 1)
        # Every key a query from here on reads is held, and little else.
        first_read = max(0, seq.num_computed_tokens - window + 1)
        held = [i for i, b in enumerate(seq.block_table) if b != kv.null_block]
        assert held[0] <= first_read // BS
        assert len(held) <= -(-window // BS) + 2
    assert seq.num_released == len(seq.block_table) - seq.num_device_blocks
    assert seq.num_device_blocks <= 4  # of the 20 blocks of its context
    kv.free(seq)
    assert kv.pool.num_free == kv.pool.num_blocks and seq.num_released == 0


def test_released_entries_stay_released_through_swap() -> None:
    window = BS + 1
    kv = KVCacheManager(
        block_size=BS, num_gpu_blocks=32, num_cpu_blocks=32, enable_prefix_caching=True,
        window=window,
    )  # fmt: skip
    seq = make_seq(list(range(200, 240)))
    kv.admit(seq, kv.find_prefix(seq))
    grow(kv, seq, 40)
    grow(kv, seq, 0)  # the next step slides
    assert seq.num_released == (40 - window + 1) // BS
    held = seq.num_device_blocks
    pairs = kv.swap_out(seq)
    assert len(pairs) == held and seq.num_released and seq.block_table == []
    assert kv.find_swap_hits(seq) == []  # its CPU blocks start after the released ones
    assert kv.can_swap_in(seq, [], 1, 0)
    copies, _ = kv.swap_in(seq, [])
    assert len(copies) == held
    assert seq.block_table[: seq.num_released] == [kv.null_block] * seq.num_released
    assert kv.null_block not in seq.block_table[seq.num_released :]


def test_invariants_name_a_released_block_the_window_still_reads() -> None:
    sim = Simulation(TRACE, config(), verify_kv=True, kv_window=WINDOW)
    sched = sim.scheduler
    for req in TRACE[:4]:
        sched.add_request(req.id, sim.prompt_of(req), req.params())
    for _ in range(200):
        if any(s.num_released for s in sched.running):
            break
        sim.engine.step()
    seq = next(s for s in sched.running if s.num_released)
    assert seq.status is SeqStatus.RUNNING and check_invariants(sched) == []
    seq.num_released += (seq.num_computed_tokens - WINDOW + 1) // BS + 1 - seq.num_released
    problems = check_invariants(sched)
    assert any("still in the window" in p for p in problems), problems


def test_a_sequence_that_slides_then_preempts_itself_leaves_no_update_behind() -> None:
    """A prefill chunk that releases blocks behind its window and still does not fit
    preempts its own sequence (the last running): the plan must not carry the released
    entries of a sequence it frees."""
    h = Harness(
        kv_window=2 * BS,
        num_gpu_blocks=13,
        enable_prefix_caching=False,
        long_prefill_token_threshold=4 * BS,
        preemption_mode="recompute",
    )
    h.add("a", 2 * BS, max_tokens=40)
    h.add("c", 6 * BS, max_tokens=20)
    h.add("b", 10 * BS, max_tokens=4)
    h.run()
    assert h.sched.preemptions["recompute"] > 0
    assert h.sched.kv.released_blocks > 0
    h.assert_reference_outputs()


def test_a_swapped_sequence_requeued_after_a_lost_worker_starts_with_a_whole_table() -> None:
    """A sequence whose swap-out rode on a step the lost worker never ran starts over
    from its tokens: its released entries go with its CPU blocks (else its next table's
    first blocks would never be given back)."""
    cfg = config(
        num_gpu_blocks=30,
        num_cpu_blocks=64,
        max_num_seqs=20,
        max_num_batched_tokens=128,
        preemption_mode="swap",
        enable_prefix_caching=False,
        long_prefill_token_threshold=0,
    )
    trace = generate_trace(30, seed=1, prompt_len=(8, 16), output_len=(80, 100), arrival_rate=None)
    sim = Simulation(trace, cfg, verify_kv=True, check_invariants=True, kv_window=6)
    sched = sim.scheduler
    for req in trace:
        sched.add_request(req.id, sim.prompt_of(req), req.params())
    victim = None
    for _ in range(2000):
        plan = sched.schedule()
        assert plan is not None
        victim = next((s for s in sched.inflight[-1].swapped_out if s.num_released), None)
        if victim is not None:
            break
        sched.update(sim.worker.execute(plan))
    assert victim is not None, "no sequence swapped out with released blocks"
    sched.on_worker_lost()
    assert victim.status is SeqStatus.WAITING and victim.num_released == 0
    assert check_invariants(sched) == []
    sim.worker = type(sim.worker)(
        sim.model, block_size=BS, num_gpu_blocks=30, num_cpu_blocks=64, window=sched.kv.window
    )  # a new worker: empty cache
    for _ in range(5000):
        if not sched.has_work():
            break
        plan = sched.schedule()
        if plan is not None:
            sched.update(sim.worker.execute(plan))
            assert check_invariants(sched) == []
    assert not sched.seqs and sched.kv.pool.num_free == sched.kv.pool.num_blocks


WINDOW_HIT_TRACE = generate_trace(
    60,
    seed=7,
    prompt_len=(44, 70),
    output_len=(1, 30),
    arrival_rate=2.0,
    n_choices=(1, 1, 2),
    eos_fraction=0.3,
    abort_fraction=0.1,
    shared_prefixes=2,
    shared_prefix_len=40,
)
"""Shared prefixes four windows long: their first blocks are released (and evicted)
while the later ones stay cached, so later requests hit only what the window reads."""


@pytest.mark.parametrize(("overlap", "mode"), [(False, "swap"), (True, "recompute")])
def test_prefix_hits_on_only_the_windows_blocks_keep_every_output(overlap: bool, mode: str) -> None:
    cfg = config(preemption_mode=mode, num_gpu_blocks=40)
    sim, result = checked_run(WINDOW_HIT_TRACE, cfg, overlap=overlap, kv_window=WINDOW)
    assert sim.scheduler.kv.window_hits > 10
    assert sum(result.summary["preemptions"].values()) > 0


def test_a_window_hit_is_confirmed_by_the_digest_of_its_whole_prefix() -> None:
    window = BS + 2
    kv = KVCacheManager(
        block_size=BS, num_gpu_blocks=64, num_cpu_blocks=0, enable_prefix_caching=True,
        window=window,
    )  # fmt: skip
    prompt = list(range(300, 324))  # 6 blocks
    first = make_seq(prompt)
    kv.admit(first, kv.find_prefix(first))
    grow(kv, first, len(prompt))
    grow(kv, first, 0)  # the next step slides: blocks 0-3 released, 4-5 held
    assert first.num_released == 4
    held = first.block_table[4:]
    assert kv.pool.allocate(kv.pool.num_free)  # the released blocks evicted on the way
    assert all(kv.pool.block_hash[b] is None for b in range(4))
    second = make_seq([*prompt, 1, 2, 3])
    hits = kv.find_prefix(second)
    assert hits == [kv.null_block] * 4 + held  # the window's blocks only
    assert kv.find_cached(second, 6) == []  # the whole chain is gone
    kv.admit(second, hits)
    assert second.num_released == 4 and second.num_computed_tokens == 24
    assert kv.pool.ref_cnt[held[0]] == 2 and kv.window_hits == 1
    # Another prefix ending in the same tokens: its chained hashes differ, no hit.
    other = make_seq([*range(400, 416), *prompt[16:], 1, 2, 3])
    assert kv.find_prefix(other) == []
    # A block under the right hash but the wrong digest (a collision) is not taken.
    assert kv.digests is not None
    kv.digests[held[0]] = bytes(16)
    assert kv.find_prefix(make_seq([*prompt, 1, 2, 3])) == []
