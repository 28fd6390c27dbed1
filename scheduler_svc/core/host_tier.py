"""The prefix cache's host tier (``prefix_cache_cpu_blocks``): device blocks evicted
from the prefix cache are kept in the CPU pool and copied back on a later hit.

**Where the blocks live.** The tier owns ``prefix_cache_cpu_blocks`` blocks of the CPU
swap pool (the same pinned shared-memory segment preemption swaps into) for as long as
the scheduler runs; swap keeps the rest.

**Demotion.** When an allocation evicts a cached device block (its refcount is zero
and the free queue reaches it), the tier takes a block of its own, the least recently
used one if none is empty, and the step's plan copies the device block there
(``BatchPlan.swap_out``). The worker runs ``swap_out`` before anything else of the
step, so the copy reads the K/V before the block's new owner writes it.

**Hits.** Admission walks a prompt's full blocks through the device cache first, then
on through the tier: each block found there is copied into a new device block
(``BatchPlan.swap_in``, after ``swap_out``, before the forward) instead of computed, when
the cost model says the copy is cheaper (:meth:`~scheduler_svc.core.policies.
PreemptionCostModel.copy_in_seconds`). A tier block being read by a step in flight is
pinned until that step's result is applied, so no demotion overwrites it meanwhile; a
demotion and a hit on the same tier block in one step are ordered by the worker
(``swap_out`` first), so the hit reads the new content it was found by.

**Keys.** A device block's key names its parent by cache entry, which means nothing once
both are evicted, so the tier keys a block by a digest of its whole prefix: a keyed
128-bit BLAKE2b chain over the tokens (:func:`block_digest`; the key is random per
process, so a client cannot aim at a collision). A hit is a digest match: a wrong hit
would need a BLAKE2b collision.

**Loss.** When the workers are reset (a worker died), whatever the lost steps were to
copy may never have been copied: the tier forgets everything (:meth:`reset`).
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from scheduler_svc.core.block_pool import CpuBlockPool
from scheduler_svc.core.kv_events import KVEventLog
from scheduler_svc.core.request import Sequence

__all__ = ["HostPrefixTier", "block_digest", "sequence_digests"]

_DIGEST_KEY = secrets.token_bytes(16)


def block_digest(parent: bytes, tokens: Iterable[int]) -> bytes:
    """The digest of a full block: its tokens chained to its parent's digest (b"" for
    a first block)."""
    digest = hashlib.blake2b(parent, digest_size=16, key=_DIGEST_KEY)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def sequence_digests(seq: Sequence, num_blocks: int, block_size: int) -> list[bytes]:
    """``seq``'s first ``num_blocks`` full-block digests (computed once, kept on it)."""
    digests = seq.block_digests
    tokens = seq.token_ids
    while len(digests) < num_blocks:
        index = len(digests)
        parent = digests[-1] if digests else b""
        digests.append(block_digest(parent, tokens[index * block_size : (index + 1) * block_size]))
    return digests


class HostPrefixTier:
    """The tier's blocks, what each holds, least recently used first, and pins."""

    def __init__(self, cpu_pool: CpuBlockPool, num_blocks: int, num_device_blocks: int) -> None:
        self.blocks = cpu_pool.allocate(num_blocks)
        """The CPU pool blocks the tier holds (for the scheduler's lifetime)."""
        self._empty = list(reversed(self.blocks))
        self._lru: OrderedDict[int, bytes] = OrderedDict()
        """Tier blocks holding a prefix block -> its digest, least recently used first."""
        self.cached: dict[bytes, int] = {}
        """Digest -> tier block."""
        self._pins: dict[int, int] = {}
        """Tier block -> steps in flight that copy it to the device."""
        self.device_digest: list[bytes | None] = [None] * num_device_blocks
        """Per device block, the digest of what it caches (set when it enters the
        device prefix cache; read when it is evicted)."""
        self.pending: list[tuple[int, int]] = []
        """(device block, tier block) copies the next plan must carry."""
        self._filling: set[int] = set()
        """Their tier blocks (not to be taken again before the plan carries them)."""
        self.events: KVEventLog | None = None
        """Where the blocks the tier keeps and overwrites are recorded, when they are."""
        self.event_hash: dict[int, int] = {}
        """While recording: tier block -> the content hash it was announced by (none for
        a block kept without an event: a layer group's copy of announced content)."""
        self.num_demoted = 0
        self.num_dropped = 0
        """Evicted device blocks the tier had no unpinned block for."""
        self.hit_tokens = 0

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def demote(
        self, device_block: int, announce: tuple[int, int | None, tuple[int, ...]] | None = None
    ) -> None:
        """The device cache is evicting ``device_block``: keep its content. ``announce``:
        its (content hash, parent's content hash, tokens), for :attr:`events`."""
        digest = self.device_digest[device_block]
        self.device_digest[device_block] = None
        if digest is None:
            return
        known = self.cached.get(digest)
        if known is not None:  # the host already holds it (it was copied back from here)
            self._lru.move_to_end(known)
            return
        block = self._take()
        if block is None:
            self.num_dropped += 1
            return
        self.cached[digest] = block
        self._lru[block] = digest
        self.pending.append((device_block, block))
        self._filling.add(block)
        self.num_demoted += 1
        if self.events is not None and announce is not None:
            self.event_hash[block] = announce[0]
            self.events.stored("CPU", *announce)

    def _take(self) -> int | None:
        if self._empty:
            return self._empty.pop()
        filling = self._filling
        for block in self._lru:  # the least recently used block no step reads or fills
            if block not in self._pins and block not in filling:
                del self.cached[self._lru.pop(block)]
                announced = self.event_hash.pop(block, None)  # None: kept without an event
                if self.events is not None and announced is not None:
                    self.events.removed("CPU", announced)
                return block
        return None

    def find(self, seq: Sequence, start: int, stop: int, block_size: int) -> list[int]:
        """Tier blocks holding ``seq``'s full blocks ``start``, ``start + 1``, ... (up to
        ``stop``), as far as the tier has them in a row."""
        if start >= stop or not self._lru:
            return []
        found = []
        for index in range(start, stop):  # digests only as far as the walk goes
            block = self.cached.get(sequence_digests(seq, index + 1, block_size)[index])
            if block is None:
                break
            found.append(block)
        return found

    def pin(self, blocks: list[int]) -> None:
        """A step copies ``blocks`` to the device: used now, kept until it is done."""
        pins = self._pins
        lru = self._lru
        for block in blocks:
            pins[block] = pins.get(block, 0) + 1
            lru.move_to_end(block)

    def unpin(self, blocks: Iterable[int]) -> None:
        pins = self._pins
        for block in blocks:
            count = pins[block] - 1
            if count:
                pins[block] = count
            else:
                del pins[block]

    def take_pending(self) -> list[tuple[int, int]]:
        pending, self.pending = self.pending, []
        self._filling.clear()
        return pending

    def reset(self) -> None:
        """Forget every block (the workers lost the steps that were to fill them)."""
        self._empty = list(reversed(self.blocks))
        self._lru.clear()
        self.cached.clear()
        self._pins.clear()
        self.pending.clear()
        self._filling.clear()
        self.event_hash.clear()
        self.device_digest = [None] * len(self.device_digest)

    def check(self, pinned: list[int]) -> list[str]:
        """Invariant violations; ``pinned``: the tier blocks steps in flight copy."""
        problems = []
        held = set(self._empty) | set(self._lru)
        if len(self._empty) + len(self._lru) != len(self.blocks) or held != set(self.blocks):
            problems.append("host tier: empty and cached blocks are not its blocks")
        if {block: digest for digest, block in self.cached.items()} != dict(self._lru):
            problems.append("host tier: digests and blocks disagree")
        counts: dict[int, int] = {}
        for block in pinned:
            counts[block] = counts.get(block, 0) + 1
        if counts != self._pins:
            problems.append(f"host tier: pins {self._pins} but steps in flight read {counts}")
        return problems
