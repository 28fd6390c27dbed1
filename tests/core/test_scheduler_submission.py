"""Submitting to the scheduler core: defaults, refusals and their counts, sequence ids,
the capacity the watermark leaves, and the queue order of a request's samples.

See tests/core/test_scheduler_unit.py for the rejection rules themselves.
"""

from __future__ import annotations

import pytest
from support.harness import Harness, rejected

from ipc.schema import ErrorCode, SeqStatus
from scheduler_svc.core.introspection import snapshot
from scheduler_svc.core.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams


def test_a_scheduler_needs_a_block_count() -> None:
    config = SchedulerConfig(num_gpu_blocks=None)
    with pytest.raises(
        ValueError,
        match=r"^the scheduler needs num_gpu_blocks \(from config or the workers\)$",
    ):
        Scheduler(config, eos_token_ids=[2], kv_bytes_per_block=1024)


def test_a_request_submitted_without_priority_or_client_gets_the_defaults() -> None:
    h = Harness()
    request = h.sched.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    assert request.priority == 0 and request.client == ""
    assert request.seqs[0].seq_id == "r"


def test_every_refusal_is_counted() -> None:
    h = Harness(max_model_len=32)
    for index in range(3):
        rejected(h, f"r{index}", 10, max_tokens=30)
    assert h.sched.finished_counts["rejected"] == 3
    assert h.sched.requests == {}


def test_a_request_id_naming_a_forked_sample_of_another_request_is_refused() -> None:
    h = Harness()
    h.add("x", 5, max_tokens=4, n=2)
    h.step()  # the prompt is done: "x/1" is forked
    assert set(h.sched.seqs) == {"x/0", "x/1"}
    error = rejected(h, "x/1", 5, max_tokens=2)
    assert error.code is ErrorCode.DUPLICATE
    assert error.message == "sequence id 'x/1' is already in use"
    h.add("x/2", 5, max_tokens=2)  # no such sample: fine
    h.run()
    h.assert_reference_outputs()


def test_a_request_id_naming_a_sample_still_to_fork_is_refused() -> None:
    h = Harness()
    h.add("x", 5, max_tokens=2, n=2)
    error = rejected(h, "x/1", 5, max_tokens=2)
    assert error.code is ErrorCode.DUPLICATE
    assert error.message == "sequence id 'x/1' is already in use"
    # Nor may a request with samples take the id of a waiting request.
    h.add("y/0", 5, max_tokens=2)
    assert rejected(h, "y", 5, max_tokens=2, n=2).code is ErrorCode.DUPLICATE
    h.run()
    h.assert_reference_outputs()
    # Once a request is done, its ids are free again.
    h.add("x/1", 5, max_tokens=2)
    h.add("y", 5, max_tokens=2, n=2)
    h.run()
    h.assert_reference_outputs()
    assert h.sched.seq_ids_taken == set()


def test_the_watermark_lowers_the_largest_request_accepted() -> None:
    # 8 blocks with a 25% watermark: at most 6 blocks (24 tokens) per request.
    h = Harness(num_gpu_blocks=8, watermark=0.25, max_model_len=64)
    h.add("fits", 20, max_tokens=4)
    error = rejected(h, "too-big", 20, max_tokens=5)
    assert error.code is ErrorCode.REJECTED
    assert error.message == "25 tokens need 7 KV blocks; the cache admits at most 6"
    h.run()
    h.assert_reference_outputs()


def test_the_samples_of_a_request_keep_their_order_in_the_queue() -> None:
    # Both samples of "low" are preempted for "vip" (the second one first); back in the
    # queue, sample 0 is still ahead of sample 1.
    h = Harness(num_gpu_blocks=8, policy="priority")
    low = h.add("low", 6, max_tokens=12, n=2, temperature=1.0, priority=5)
    h.step()
    h.step()
    assert [s.status for s in low.seqs] == [SeqStatus.RUNNING] * 2
    h.add("vip", 28, max_tokens=2, priority=0)
    h.step()
    assert h.last.preempted == [("low/1", "recompute"), ("low/0", "recompute")]
    waiting = [s.seq_id for s in snapshot(h.sched).seqs if s.state is SeqStatus.WAITING]
    assert waiting == ["low/0", "low/1"]
    h.run()
    h.assert_reference_outputs()
