"""A priority queue of sequences ordered by their static key, with O(log n) removal."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from scheduler_svc.core.request import QueueKey, Sequence


class SeqQueue:
    """Min-heap on ``Sequence.key``; removed entries are skipped lazily.

    Keys are unique (they end in arrival number and sample index), so entries never
    compare sequences themselves.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[QueueKey, int, Sequence]] = []
        self._live: dict[str, int] = {}
        """seq_id -> ticket of its live heap entry."""
        self._ticket = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._live

    def __iter__(self) -> Iterator[Sequence]:
        """Live sequences in queue order."""
        live = [e for e in self._heap if self._live.get(e[2].seq_id) == e[1]]
        return (e[2] for e in sorted(live))

    def first(self, count: int) -> list[Sequence]:
        """The first ``count`` live sequences in queue order: a best-first walk down the
        heap from its root (O(count log count) plus the removed entries met)."""
        heap, live = self._heap, self._live
        found: list[Sequence] = []
        frontier = [(heap[0], 0)] if heap else []
        while frontier and len(found) < count:
            entry, index = heapq.heappop(frontier)
            if live.get(entry[2].seq_id) == entry[1]:
                found.append(entry[2])
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
        return found

    def push(self, seq: Sequence) -> None:
        self._ticket += 1
        self._live[seq.seq_id] = self._ticket
        heapq.heappush(self._heap, (seq.key, self._ticket, seq))

    def peek(self) -> Sequence | None:
        heap = self._heap
        while heap and self._live.get(heap[0][2].seq_id) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty queue")
        heapq.heappop(self._heap)
        del self._live[seq.seq_id]
        return seq

    def remove(self, seq: Sequence) -> None:
        del self._live[seq.seq_id]
