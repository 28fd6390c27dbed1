"""Block pools: device blocks with refcounts and a prefix cache, and the CPU swap pool.

The device pool's free queue holds every block whose refcount is zero, in eviction
order (least recently freed first). A free block may still hold a cached prefix: it is
reusable by a prefix hit until allocation evicts it from the front of the queue. So
"free" always includes "evictable cached", and an allocation never fails while the
free queue has enough blocks.

The free queue is a deque of block ids. Taking a block out of its middle (a prefix hit
on a free cached block) only marks that entry stale; allocation skips stale entries.
Every operation is O(1) (compaction is amortised), and the queue is a compact array,
not a linked node per block, which keeps the pool's memory footprint small.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.core.kv_events import KVEventLog

BlockKey = tuple[int, tuple[int, ...]]
"""(the cache entry of the previous block of the prefix, this block's tokens).

A cached block's K/V depend on its whole prefix. The key names the prefix by the entry
that holds it (:attr:`DeviceBlockPool.entry`: a number given to each registration, never
reused, so a key cannot name a block evicted and cached again with other content), and a
lookup walks a prompt from its first block, confirming each block before trying the
next; by induction a confirmed key identifies the whole prefix exactly, so a hash
collision can cost a hit but never hand out wrong K/V.
"""

NO_PARENT = -1


def chain_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """Content hash of a full block, chained to the hash of the block before it.

    Ints and tuples of ints hash identically in every process (no hash seed applies).
    """
    return hash((parent_hash, tokens))


class DeviceBlockPool:
    """Fixed pool of device block ids with refcounts, prefix cache and LRU eviction."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        """Content hash -> block holding that content."""
        self.entry = [NO_PARENT] * num_blocks
        """Per cached block, the number of its registration (keys name parents by it)."""
        self.parent_hash: list[int | None] = [None] * num_blocks
        """Per cached block, its parent's content hash (None for a first block)."""
        self.quiet = [False] * num_blocks
        """Per cached block, whether it was cached without an event (a layer group's
        copy of content its first group's block announces)."""
        self.events: KVEventLog | None = None
        """Where cache registrations and evictions are recorded, when they are
        (:meth:`scheduler_svc.core.kv_manager.KVCacheManager.record_events`)."""
        self._entries = 0
        self.num_shared = 0
        """Blocks with more than one reference: while none is, no copy-on-write is due."""
        self._free: deque[int] = deque(range(num_blocks))
        """Free blocks, least recently freed first, plus stale entries (see ``_stale``)."""
        self._is_free = [True] * num_blocks
        self._stale = [0] * num_blocks
        """Per block, entries of ``_free`` left behind when it was taken out of the middle:
        always older than its live entry, so the first ones met from the front."""
        self._num_stale = 0
        self.free_queue = FreeQueue(self)
        """The free queue as an ordered collection (len, in, iteration)."""
        self.on_evict: Callable[[int], None] | None = None
        """Called with each cached block an allocation evicts, before it forgets it
        (the host tier keeps its content)."""

    @property
    def num_free(self) -> int:
        return len(self._free) - self._num_stale

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._iter_free() if self.block_hash[b] is not None)

    def _iter_free(self) -> Iterator[int]:
        """Free blocks in eviction order."""
        pending = {b: n for b, n in enumerate(self._stale) if n} if self._num_stale else {}
        for block in self._free:
            if pending.get(block):
                pending[block] -= 1
            else:
                yield block

    def _push_free(self, block: int) -> None:
        if not self._is_free[block]:
            self._is_free[block] = True
            self._free.append(block)

    def _take_free(self, block: int) -> None:
        """Take a free block out of the middle of the queue."""
        if not self._is_free[block]:
            raise KeyError(block)
        self._is_free[block] = False
        self._stale[block] += 1
        self._num_stale += 1
        if self._num_stale > self.num_blocks:
            self._free = deque(self._iter_free())
            self._stale = [0] * self.num_blocks
            self._num_stale = 0

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the front of the free queue, evicting cached content."""
        if count > self.num_free:
            raise RuntimeError(f"allocate({count}) with only {self.num_free} free blocks")
        popleft = self._free.popleft
        stale = self._stale
        is_free = self._is_free
        block_hash = self.block_hash
        ref_cnt = self.ref_cnt
        blocks = []
        for _ in range(count):
            block = popleft()
            while stale[block]:
                stale[block] -= 1
                self._num_stale -= 1
                block = popleft()
            is_free[block] = False
            if block_hash[block] is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                self._uncache(block)
            ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a prefix hit or a fork)."""
        ref_cnt = self.ref_cnt
        for block in blocks:
            count = ref_cnt[block]
            if count == 0:
                self._take_free(block)
            elif count == 1:
                self.num_shared += 1
            ref_cnt[block] = count + 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference; blocks reaching zero join the back of the free queue.

        Pass a table's blocks last-first, so a sequence's tail is evicted before its
        prefix, which is the part other requests are likeliest to share.
        """
        ref_cnt = self.ref_cnt
        append = self._free.append
        is_free = self._is_free
        for block in blocks:
            count = ref_cnt[block] - 1
            ref_cnt[block] = count
            if count == 0:
                is_free[block] = True
                append(block)
            elif count == 1:
                self.num_shared -= 1

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        """The block caching exactly this content, if any."""
        block = self.cached.get(block_hash)
        if block is not None and self.block_key[block] == key:
            return block
        return None

    def cache(
        self,
        block: int,
        block_hash: int,
        key: BlockKey,
        parent_hash: int | None = None,
        announce: bool = True,
    ) -> None:
        """Register a full block's content (``parent_hash``: the content hash of the
        block before it); a second copy of known content stays private. ``announce``:
        record it in :attr:`events` (and its eviction later)."""
        if block_hash in self.cached or self.block_hash[block] is not None:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        self.block_key[block] = key
        self.parent_hash[block] = parent_hash
        self.entry[block] = self._entries
        self._entries += 1
        self.quiet[block] = not announce
        if self.events is not None and announce:
            self.events.stored("GPU", block_hash, parent_hash, key[1])

    def uncache(self, block: int) -> None:
        if self.block_hash[block] is not None:
            self._uncache(block)

    def _uncache(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if self.cached.get(block_hash) == block:  # type: ignore[arg-type]
            del self.cached[block_hash]  # type: ignore[arg-type]
            if self.events is not None and not self.quiet[block]:
                self.events.removed("GPU", block_hash)  # type: ignore[arg-type]
        self.block_hash[block] = None
        self.block_key[block] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after the device cache was lost, e.g. a worker
        died); recorded as one ``cleared`` by the caller, not block by block."""
        events, self.events = self.events, None
        for block in list(self.cached.values()):
            self._uncache(block)
        self.events = events

    def check(self, expected_refs: list[int]) -> list[str]:
        """Invariant violations against the refcounts the block tables imply."""
        problems = []
        for block, (have, want) in enumerate(zip(self.ref_cnt, expected_refs, strict=True)):
            if have != want:
                problems.append(f"device block {block}: refcount {have}, held by {want} tables")
            if (have == 0) != self._is_free[block]:
                flagged = self._is_free[block]
                problems.append(f"device block {block}: refcount {have} but free={flagged}")
        shared = sum(1 for r in self.ref_cnt if r > 1)
        if shared != self.num_shared:
            problems.append(f"{shared} device blocks shared, counted {self.num_shared}")
        used = sum(1 for r in self.ref_cnt if r > 0)
        if used + self.num_free != self.num_blocks:
            problems.append(
                f"device blocks: {used} used + {self.num_free} free != {self.num_blocks}"
            )
        if self.num_free != sum(self._is_free):
            problems.append(
                f"free queue holds {self.num_free} blocks, flagged {sum(self._is_free)}"
            )
        for block_hash, block in self.cached.items():
            if self.block_hash[block] != block_hash:
                problems.append(f"prefix cache maps {block_hash} to block {block} holding another")
        return problems


class FreeQueue:
    """A device pool's free queue seen as an ordered collection of block ids.

    Reads (``len``, ``in``, iteration in eviction order) plus ``queue[block] = None``
    (append) and ``del queue[block]`` (take out), as on the ``OrderedDict`` it replaces;
    the pool's own operations use its internals directly.
    """

    __slots__ = ("_pool",)

    def __init__(self, pool: DeviceBlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_free

    def __contains__(self, block: int) -> bool:
        return self._pool._is_free[block]

    def __iter__(self) -> Iterator[int]:
        return self._pool._iter_free()

    def __setitem__(self, block: int, value: None) -> None:
        self._pool._push_free(block)

    def __delitem__(self, block: int) -> None:
        self._pool._take_free(block)


class CpuBlockPool:
    """The swap pool: CPU block ids, each held by at most one swapped sequence."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._in_use = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"allocate({count}) with only {len(self._free)} free CPU blocks")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._in_use[block] = True
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if not self._in_use[block]:
                raise RuntimeError(f"CPU block {block} released twice")
            self._in_use[block] = False
            self._free.append(block)

    def check(self, held: list[int]) -> list[str]:
        problems = []
        if len(held) != len(set(held)):
            problems.append("a CPU block is held by two swapped sequences")
        in_use = {b for b, used in enumerate(self._in_use) if used}
        if in_use != set(held):
            problems.append(
                f"CPU blocks in use {sorted(in_use)[:8]}... differ from held {sorted(held)[:8]}..."
            )
        if len(in_use) + len(self._free) != self.num_blocks:
            problems.append("CPU blocks: used + free != total")
        return problems
