"""KV-cache events (scheduler_svc/core/kv_events.py): an index built only from the
events equals the scheduler's cached blocks, on both tiers, after every operation of a
random sequence of them (admissions sharing prefixes, evictions, preemption by swap and
recompute, aborts, n>1 forks, a lost worker, a restarted scheduler)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.harness import BS, Harness, restart_worker

from scheduler_svc.core.kv_events import KVEventLog, Medium, apply_events, external_hash
from scheduler_svc.core.scheduler import Scheduler

PREFIXES = [list(range(500, 500 + 3 * BS)), list(range(600, 600 + 5 * BS)), []]


def cached_blocks(sched: Scheduler) -> set[tuple[Medium, int]]:
    """What the two tiers of the prefix cache hold, read from the scheduler itself."""
    kv = sched.kv  # (a layer group's copy of announced content is not announced)
    announced = {h for h, block in kv.pool.cached.items() if not kv.pool.quiet[block]}
    held: set[tuple[Medium, int]] = {("GPU", external_hash(h)) for h in announced}
    if kv.host is not None:
        assert set(kv.host.event_hash) <= set(kv.host.cached.values())
        held |= {("CPU", external_hash(h)) for h in kv.host.event_hash.values()}
    return held


def harness(
    host_blocks: int, window: int, overlap: bool, preemption: str, groups: bool = False
) -> Harness:
    """``groups``: the window on one of two layer groups (the other full) instead of
    every layer."""
    h = Harness(
        enable_prefix_caching=True,
        num_gpu_blocks=28 if groups else 14,  # blocks of one group's layers: twice as many
        num_cpu_blocks=64 if groups else 32,
        prefix_cache_cpu_blocks=host_blocks,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=64,
        overlap_scheduling=overlap,
        preemption_mode=preemption,
        kv_window=0 if groups else window,
        kv_groups=(0, window) if groups else (),
    )
    h.sched.kv.record_events()
    return h


adds = st.tuples(
    st.just("add"),
    st.integers(0, len(PREFIXES) - 1),
    st.integers(1, 9),
    st.integers(1, 12),
    st.sampled_from([1, 1, 2]),
)
operations = st.lists(
    st.one_of(
        adds,
        adds,
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.just(("lose",)),
        st.just(("restart",)),
    ),
    min_size=1,
    max_size=40,
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    host_blocks=st.sampled_from([0, 3, 12]),
    window=st.sampled_from([0, 0, 3 * BS]),
    overlap=st.booleans(),
    preemption=st.sampled_from(["swap", "recompute"]),
    groups=st.booleans(),
)
def test_an_index_of_the_events_is_the_cached_blocks(
    ops: list[tuple], host_blocks: int, window: int, overlap: bool, preemption: str, groups: bool
) -> None:
    """Also with layer groups (the first group's blocks announced, its copies in the
    other group's blocks not)."""
    groups = groups and window > 0
    h = harness(host_blocks, window, overlap, preemption, groups)
    index: set[tuple[Medium, int]] = {("GPU", 1)}  # a subscriber's stale state
    added = 0
    for op in [*ops, ("step", 1000)]:
        if op[0] == "add":
            _, prefix, suffix, max_tokens, n = op
            prompt = PREFIXES[prefix] + [700 + 10 * added + i for i in range(suffix)]
            h.add(f"r{added}", prompt, max_tokens=max_tokens, n=n)
            added += 1
        elif op[0] == "step":
            for _ in range(op[1]):
                if not h.engine.has_work():
                    break
                h.step()
                apply_events(index, h.sched.kv.events.take())  # type: ignore[union-attr]
                assert index == cached_blocks(h.sched)
        elif op[0] == "abort" and added:
            h.sched.abort(f"r{op[1] % added}")
        elif op[0] == "lose":
            h.sched.on_worker_lost()
            restart_worker(h)
        elif op[0] == "restart":  # a new scheduler process: its log starts with cleared
            h = harness(host_blocks, window, overlap, preemption, groups)
            added = 0
        apply_events(index, h.sched.kv.events.take())  # type: ignore[union-attr]
        assert index == cached_blocks(h.sched)
    assert h.sched.kv.pool.num_free == h.sched.kv.pool.num_blocks


def test_stores_along_one_chain_merge_into_one_event() -> None:
    log = KVEventLog(block_size=2)
    assert log.take() == [("cleared",)]
    log.stored("GPU", 10, None, (1, 2))
    log.stored("GPU", 11, 10, (3, 4))
    log.stored("CPU", 12, 11, (5, 6))  # another tier: a new event
    log.stored("CPU", -5, 99, (7, 8))  # another chain: a new event; hashes folded >= 0
    log.removed("GPU", 10)
    log.removed("GPU", 11)
    assert log.take() == [
        ("stored", "GPU", [10, 11], None, [1, 2, 3, 4]),
        ("stored", "CPU", [12], 11, [5, 6]),
        ("stored", "CPU", [external_hash(-5)], 99, [7, 8]),
        ("removed", "GPU", [10, 11]),
    ]
    assert 0 <= external_hash(-5) < 2**63
    log.stored("GPU", 1, None, (1, 2))
    log.cleared()  # what came before no longer matters
    assert log.take() == [("cleared",)]


def test_a_hit_announces_nothing_and_an_eviction_announces_the_host_copy() -> None:
    h = harness(host_blocks=16, window=0, overlap=False, preemption="recompute")
    log = h.sched.kv.events
    assert log is not None
    prefix = PREFIXES[1]
    h.add("a", [*prefix, 1], max_tokens=1)
    h.run()
    events = log.take()
    stored = [e for e in events if e[0] == "stored"]
    assert events[0] == ("cleared",)
    assert stored == [("stored", "GPU", stored[0][2], None, prefix)]
    assert len(stored[0][2]) == len(prefix) // BS
    h.add("b", [*prefix, 2], max_tokens=1)  # a hit on every full block of the prefix
    h.run()
    assert [e for e in log.take() if e[0] == "stored" and e[4][: len(prefix)] == prefix] == []
    for index in range(3):  # push the prefix out of the 14-block pool
        h.add(f"o{index}", h.model.prompt(f"o{index}", 10 * BS), max_tokens=1)
        h.run()
    events = log.take()
    removed = {x for e in events if e[0] == "removed" and e[1] == "GPU" for x in e[2]}
    to_host = {x for e in events if e[0] == "stored" and e[1] == "CPU" for x in e[2]}
    assert set(stored[0][2]) <= removed and set(stored[0][2]) <= to_host
