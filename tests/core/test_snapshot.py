"""introspection.snapshot() and check_invariants() on a live scheduler."""

from __future__ import annotations

import msgspec
from support.harness import Harness

from ipc.schema import SchedulerSnapshot, decode, encode
from scheduler_svc.core.introspection import check_invariants, snapshot
from shared.sampling import SamplingParams


def make() -> Harness:
    """A pool of 12 blocks of 4 that a few requests outgrow (swap preemption)."""
    return Harness(
        num_gpu_blocks=12,
        num_cpu_blocks=16,
        max_num_seqs=4,
        max_model_len=64,
        preemption_mode="swap",
        kv_bytes_per_block=1024,
    )


def test_snapshot_reports_queues_blocks_and_requests() -> None:
    h = make()
    sched = h.sched
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    sched.add_request("a", list(range(3, 19)), greedy)  # 16 tokens: 4 blocks
    sched.add_request("b", list(range(3, 19)), greedy, priority=1)  # same prompt
    sched.add_request("c", list(range(40, 60)), greedy)
    h.step()
    snap = snapshot(sched)
    assert snap.num_running == 3 and snap.num_waiting == 0
    assert snap.gpu_blocks.total == 12
    # a and b share 3 full prompt blocks (b hits 12 of its 16 tokens); c needs 5.
    assert snap.prefix_cache.hit_tokens == 12
    assert snap.prefix_cache.queried_tokens == 16 + 16 + 20
    states = {info.seq_id: info for info in snap.seqs}
    assert set(states) == {"a", "b", "c"}
    assert states["b"].priority == 1 and states["b"].state == "running"
    assert states["a"].num_output_tokens == 1 and states["a"].num_computed_tokens == 16
    used = 12 - snap.gpu_blocks.free
    assert used == 4 + 1 + 5
    for _ in range(8):
        h.step()
    snap = snapshot(sched)
    assert snap.preemptions["swap"] >= 1
    assert snap.num_swapped + snap.num_waiting >= 1
    swapped = [i for i in snap.seqs if i.state == "swapped"]
    assert all(i.num_cpu_blocks > 0 and i.num_gpu_blocks == 0 for i in swapped)
    assert isinstance(decode(encode(snap)), SchedulerSnapshot)
    assert msgspec.json.decode(msgspec.json.encode(snap), type=SchedulerSnapshot) == snap


def test_check_invariants_names_a_corrupted_refcount() -> None:
    h = make()
    sched = h.sched
    sched.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=4))
    h.step()
    block = sched.running[0].block_table[0]
    sched.kv.pool.ref_cnt[block] += 1
    problems = check_invariants(sched)
    assert any(f"device block {block}: refcount 2, held by 1" in p for p in problems)


def test_check_invariants_names_a_sequence_in_two_queues() -> None:
    h = make()
    sched = h.sched
    sched.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=4))
    h.step()
    sched.waiting.push(sched.running[0])
    assert any("is in running and waiting" in p for p in check_invariants(sched))
