"""SeqQueue: a min-heap of sequences on their static key, with lazy removal."""

from __future__ import annotations

import pytest

from scheduler_svc.core.queues import SeqQueue
from scheduler_svc.core.request import Request, Sequence
from shared.sampling import SamplingParams


def make_seq(arrival: int, *, priority: float = 0.0, sample_index: int = 0) -> Sequence:
    request = Request(
        f"r{arrival}",
        [1, 2, 3],
        SamplingParams(temperature=0.0, n=sample_index + 1),
        priority=0,
        arrival_step=0,
        arrival_seq=arrival,
        max_output_tokens=16,
    )
    return Sequence(request, sample_index, [1, 2, 3], (priority, arrival, sample_index))


def ids(queue: SeqQueue) -> list[str]:
    return [seq.seq_id for seq in queue]


def test_empty_queue() -> None:
    queue = SeqQueue()
    assert len(queue) == 0
    assert queue.peek() is None
    assert list(queue) == []
    with pytest.raises(IndexError, match=r"^pop from an empty queue$"):
        queue.pop()


def test_pop_returns_sequences_in_key_order() -> None:
    queue = SeqQueue()
    seqs = [make_seq(3), make_seq(1), make_seq(4, priority=-1.0), make_seq(2)]
    for seq in seqs:
        queue.push(seq)
    assert len(queue) == 4
    assert [queue.pop().seq_id for _ in range(4)] == ["r4", "r1", "r2", "r3"]
    assert len(queue) == 0


def test_sample_index_breaks_ties_within_a_request() -> None:
    queue = SeqQueue()
    second = make_seq(1, sample_index=1)
    first = make_seq(1, sample_index=0)
    queue.push(second)
    queue.push(first)
    assert queue.pop() is first
    assert queue.pop() is second


def test_peek_does_not_remove() -> None:
    queue = SeqQueue()
    a, b = make_seq(2), make_seq(1)
    queue.push(a)
    queue.push(b)
    assert queue.peek() is b
    assert queue.peek() is b
    assert len(queue) == 2
    assert queue.pop() is b
    assert queue.peek() is a


def test_contains_and_iter_in_order_without_consuming() -> None:
    queue = SeqQueue()
    a, b, c = make_seq(5), make_seq(3), make_seq(4)
    for seq in (a, b, c):
        queue.push(seq)
    assert ids(queue) == ["r3", "r4", "r5"]
    assert ids(queue) == ["r3", "r4", "r5"]  # iterating twice is fine
    assert a in queue and b in queue and c in queue
    assert make_seq(9) not in queue
    assert len(queue) == 3


def test_remove_hides_a_sequence_everywhere() -> None:
    queue = SeqQueue()
    a, b, c = make_seq(1), make_seq(2), make_seq(3)
    for seq in (a, b, c):
        queue.push(seq)
    queue.remove(b)
    assert len(queue) == 2
    assert b not in queue
    assert ids(queue) == ["r1", "r3"]
    assert queue.pop() is a
    assert queue.pop() is c
    with pytest.raises(IndexError):
        queue.pop()


def test_removing_the_head_updates_peek() -> None:
    queue = SeqQueue()
    a, b = make_seq(1), make_seq(2)
    queue.push(a)
    queue.push(b)
    queue.remove(a)
    assert queue.peek() is b
    assert len(queue) == 1


def test_remove_then_push_again_gives_one_entry() -> None:
    queue = SeqQueue()
    a, b = make_seq(1), make_seq(2)
    queue.push(a)
    queue.push(b)
    queue.remove(a)
    queue.push(a)
    assert len(queue) == 2
    assert ids(queue) == ["r1", "r2"]
    assert queue.pop() is a
    assert queue.pop() is b
    assert len(queue) == 0
    assert queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_push_after_pop_requeues() -> None:
    queue = SeqQueue()
    a, b = make_seq(1), make_seq(2)
    queue.push(a)
    queue.push(b)
    assert queue.pop() is a
    queue.push(a)
    assert a in queue
    assert ids(queue) == ["r1", "r2"]
    assert [queue.pop(), queue.pop()] == [a, b]


def test_many_removals_and_pushes_keep_the_order() -> None:
    queue = SeqQueue()
    seqs = [make_seq(i) for i in range(1, 21)]
    for seq in reversed(seqs):
        queue.push(seq)
    for seq in seqs[::3]:
        queue.remove(seq)
    for seq in seqs[::6]:
        queue.push(seq)
    expected = [s.seq_id for s in seqs if s in set(seqs[::6]) or s not in set(seqs[::3])]
    assert ids(queue) == expected
    assert len(queue) == len(expected)
    assert [queue.pop().seq_id for _ in range(len(expected))] == expected
    assert len(queue) == 0
