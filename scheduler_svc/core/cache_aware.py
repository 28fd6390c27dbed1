"""Cache-aware admission (``cache_aware_admission``): which waiting sequence to admit
next when the prefix cache makes some cheaper than others.

The static queue order (FCFS or priority, fair-share rounds) says who is owed a slot;
this module may admit a sequence further back instead, in two cases:

- **Longest cached prefix first.** Of the first :data:`SCAN` waiting sequences (of
  the head's priority under the priority policy), the one whose prompt has the most
  blocks in the prefix cache (the device's, then the host tier's) goes first; ties
  keep queue order. Every sequence queued before it, of any priority, is passed over.
  Admitting it reuses blocks now, before admitting others evicts them.
- **One prefill warms a shared prefix.** A sequence whose first uncached block is one a
  running prefill has still to compute (chunked prefill computes a long prompt over
  several steps) waits for it: once computed, the block is a hit, not a second copy.

**The bound.** Each time a sequence is admitted ahead of waiting sequences queued
before it, each of those is *passed over* once (``Sequence.num_bypassed``). A sequence
passed over ``max_bypass`` times is a barrier: the scan stops at it, so nothing queued
after it is admitted before it, and it is not held back for a warming prefix. So no
sequence is passed over more than ``max_bypass`` times by this module; what the static
order admits ahead of it (swapped sequences with better keys, better priorities) is as
without it. ``max_bypass = 0`` is the static order.
"""

from __future__ import annotations

from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.queues import SeqQueue
from scheduler_svc.core.request import Sequence

__all__ = ["SCAN", "CacheAwareAdmission"]

SCAN = 32
"""Waiting sequences looked at per step (the scheduler's cost per step stays bounded)."""


class CacheAwareAdmission:
    """Picks the next waiting sequence to admit, one step at a time: :meth:`begin` with
    the step's running sequences, then :meth:`pick` and :meth:`admitted` per admission."""

    def __init__(self, kv: KVCacheManager, *, max_bypass: int, by_priority: bool) -> None:
        self.kv = kv
        self.max_bypass = max_bypass
        self.by_priority = by_priority
        """Only sequences of the head's ``priority`` compete (the priority policy)."""
        self._candidates: list[Sequence] | None = None
        """The first waiting sequences in queue order, this step (those still waiting)."""
        self._queued = 0
        """The waiting queue's length that the candidates were taken from, less admissions."""
        self._warming: set[int] | None = None
        self._running: list[Sequence] = []
        self.num_reordered = 0
        """Admissions that went ahead of a sequence queued before them (since start)."""
        self.num_held = 0
        """Times a sequence was held back for a prefix being warmed (since start)."""

    def begin(self, running: list[Sequence]) -> None:
        """A new step: what the queue and the running prefills hold is looked up again
        when first needed."""
        self._candidates = self._warming = None
        self._running = running

    def pick(self, waiting: SeqQueue) -> Sequence | None:
        """The waiting sequence to admit next, or None (every candidate waits for a
        prefix being warmed)."""
        candidates = self._candidates
        if candidates is None or self._queued != len(waiting):  # first, or a preemption
            candidates = self._candidates = waiting.first(SCAN)
            self._queued = len(waiting)
        if not candidates:
            return None
        kv = self.kv
        priority = candidates[0].request.priority
        best, best_hits = None, -1
        for seq in candidates:
            barrier = seq.num_bypassed >= self.max_bypass
            if seq.num_placeholders:  # preempted with a token in flight: not yet
                if barrier:
                    break
                continue
            if not barrier and self.by_priority and seq.request.priority != priority:
                continue
            found = kv.find_prefix(seq)
            hits = len(found) + len(kv.find_host(seq, found))  # either tier saves compute
            if not barrier and self._held(seq, hits):
                continue
            if hits > best_hits:
                best, best_hits = seq, hits
            if barrier:
                break
        return best

    def admitted(self, seq: Sequence) -> None:
        """``seq`` (from :meth:`pick`) was admitted and its first chunk scheduled."""
        candidates = self._candidates
        assert candidates is not None
        index = candidates.index(seq)
        for earlier in candidates[:index]:
            earlier.num_bypassed += 1
        if index:
            self.num_reordered += 1
        del candidates[index]
        self._queued -= 1
        if self._warming is not None:
            self._warming.update(self.kv.block_hashes_after(seq, seq.num_computed_tokens))

    def _held(self, seq: Sequence, hits: int) -> bool:
        """Whether ``seq``'s first uncached block is one a running prefill is still to
        compute."""
        hashes = seq.block_hashes
        if hits >= len(hashes) or hits >= (seq.num_tokens - 1) // self.kv.block_size:
            return False  # no full block after its hits to share
        warming = self._warming
        if warming is None:
            warming = self._warming = set()
            for other in self._running:
                if other.num_computed_tokens < other.num_tokens - 1:
                    warming.update(self.kv.block_hashes_after(other, other.num_computed_tokens))
        if hashes[hits] in warming:
            self.num_held += 1
            return True
        return False
