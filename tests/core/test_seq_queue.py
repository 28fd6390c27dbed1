"""The waiting and swapped queues: a heap on static keys with lazy removal."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from scheduler_svc.core.queues import SeqQueue


@dataclass
class Entry:
    seq_id: str
    key: tuple[int, int]


@given(
    st.lists(
        st.tuples(st.sampled_from(["push", "pop", "remove"]), st.integers(0, 30)),
        max_size=120,
    ),
    st.integers(1, 40),
)
def test_first_lists_the_queue_order_whatever_was_removed(ops, count) -> None:
    queue = SeqQueue()
    queued: dict[str, Entry] = {}
    for arrival, (op, value) in enumerate(ops):
        if op == "push":
            entry = Entry(f"s{arrival}", (value, arrival))
            queue.push(entry)  # type: ignore[arg-type]
            queued[entry.seq_id] = entry
        elif op == "pop" and queued:
            queued.pop(queue.pop().seq_id)
        elif op == "remove" and queued:
            victim = sorted(queued)[value % len(queued)]
            queue.remove(queued.pop(victim))  # type: ignore[arg-type]
        expected = sorted(queued.values(), key=lambda e: e.key)
        assert queue.first(count) == expected[:count]
        assert list(queue) == expected
