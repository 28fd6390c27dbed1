"""Block pools: device blocks with refcounts and a prefix cache, and the CPU swap pool.

The device pool's free queue holds every block whose refcount is zero, in eviction
order (least recently freed first). A free block may still hold a cached prefix: it is
reusable by a prefix hit until allocation evicts it from the front of the queue. So
"free" always includes "evictable cached", and an allocation never fails while the
free queue has enough blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

BlockKey = tuple[int, tuple[int, ...]]
"""(block holding the previous block of the prefix, this block's tokens).

A cached block's K/V depend on its whole prefix. The key names the prefix by the block
that holds it, and a lookup walks a prompt from its first block, confirming each block
before trying the next; by induction a confirmed key identifies the whole prefix
exactly, so a hash collision can cost a hit but never hand out wrong K/V.
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
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self.free_queue if self.block_hash[b] is not None)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the front of the free queue, evicting cached content."""
        if count > len(self.free_queue):
            raise RuntimeError(f"allocate({count}) with only {len(self.free_queue)} free blocks")
        popitem = self.free_queue.popitem
        blocks = []
        for _ in range(count):
            block, _ = popitem(last=False)
            if self.block_hash[block] is not None:
                self._uncache(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a prefix hit or a fork)."""
        ref_cnt = self.ref_cnt
        for block in blocks:
            if ref_cnt[block] == 0:
                del self.free_queue[block]
            ref_cnt[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference; blocks reaching zero join the back of the free queue.

        Pass a table's blocks last-first, so a sequence's tail is evicted before its
        prefix, which is the part other requests are likeliest to share.
        """
        ref_cnt = self.ref_cnt
        free_queue = self.free_queue
        for block in blocks:
            ref_cnt[block] -= 1
            if ref_cnt[block] == 0:
                free_queue[block] = None

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        """The block caching exactly this content, if any."""
        block = self.cached.get(block_hash)
        if block is not None and self.block_key[block] == key:
            return block
        return None

    def cache(self, block: int, block_hash: int, key: BlockKey) -> None:
        """Register a full block's content; a second copy of known content stays private."""
        if block_hash in self.cached or self.block_hash[block] is not None:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        self.block_key[block] = key

    def uncache(self, block: int) -> None:
        if self.block_hash[block] is not None:
            self._uncache(block)

    def _uncache(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if self.cached.get(block_hash) == block:  # type: ignore[arg-type]
            del self.cached[block_hash]  # type: ignore[arg-type]
        self.block_hash[block] = None
        self.block_key[block] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after the device cache was lost, e.g. a worker died)."""
        for block in list(self.cached.values()):
            self._uncache(block)

    def check(self, expected_refs: list[int]) -> list[str]:
        """Invariant violations against the refcounts the block tables imply."""
        problems = []
        for block, (have, want) in enumerate(zip(self.ref_cnt, expected_refs, strict=True)):
            if have != want:
                problems.append(f"device block {block}: refcount {have}, held by {want} tables")
            if (have == 0) != (block in self.free_queue):
                problems.append(f"device block {block}: refcount {have} but free={not have}")
        used = sum(1 for r in self.ref_cnt if r > 0)
        if used + len(self.free_queue) != self.num_blocks:
            problems.append(
                f"device blocks: {used} used + {len(self.free_queue)} free != {self.num_blocks}"
            )
        for block_hash, block in self.cached.items():
            if self.block_hash[block] != block_hash:
                problems.append(f"prefix cache maps {block_hash} to block {block} holding another")
        return problems


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
