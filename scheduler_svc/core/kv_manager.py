"""Per-sequence KV-block bookkeeping on top of the block pools.

Every mutation comes in a check/commit pair (``can_admit``/``admit`` + ``append``,
``can_append``/``append``, ``can_swap_in``/``swap_in``): the scheduler asks first and
commits only what fits, so a refused step leaves nothing half-allocated.

A sequence's device block table always covers exactly its computed tokens (those of
the steps in flight included). Full blocks are registered in the prefix cache when they
are allocated for the step that fills them, or, when that step computes a placeholder
(overlapped scheduling), with the next step's growth once the token is known; the
worker stores every new K/V of a layer before attention reads, so a sequence admitted
in the same step may already share them.

Sliding windows (``window``: the keys every layer reads at most, back from a query's
position): the leading blocks no query can read any more are released as the sequence
advances (:meth:`slide`). Their table entries then name the null block, the last device
block, which nothing allocates or writes (the workers' cache starts zeroed, so a kernel
reading it through a table sees finite zeros and masks them out). The table keeps its
length, so every index into it still means the same tokens.
"""

from __future__ import annotations

from scheduler_svc.core.block_pool import NO_PARENT, CpuBlockPool, DeviceBlockPool, chain_hash
from scheduler_svc.core.host_tier import HostPrefixTier, sequence_digests
from scheduler_svc.core.kv_events import KVEventLog
from scheduler_svc.core.request import Sequence

CopyOnWrite = tuple[int, int, int]
"""(index in the table, shared source block, private destination block)."""


class KVCacheManager:
    def __init__(
        self,
        *,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        enable_prefix_caching: bool,
        num_host_blocks: int = 0,
        window: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_groups = 1
        """Layer groups whose blocks a table holds side by side (more than one:
        :mod:`scheduler_svc.core.kv_groups`)."""
        self.window = window if num_gpu_blocks > 1 else 0
        """Keys every layer reads at most back from a query's position (0: some layer
        reads the whole context): blocks further back are released (:meth:`slide`)."""
        self.null_block = num_gpu_blocks - 1 if self.window else num_gpu_blocks
        """What a released table entry names (the last device block, outside the pool)."""
        self.pool = DeviceBlockPool(num_gpu_blocks - 1 if self.window else num_gpu_blocks)
        self.released_blocks = 0
        """Blocks given back by :meth:`slide` so far."""
        self.window_hits = 0
        """Admissions whose prefix hit held only the blocks the window reads."""
        self.digests: list[bytes | None] | None = (
            [None] * num_gpu_blocks if self.window and enable_prefix_caching else None
        )
        """With a window: per cached device block, the digest of its whole prefix
        (``host_tier.sequence_digests``), which confirms a hit whose parent block is no
        longer cached (:meth:`find_window`)."""
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.host: HostPrefixTier | None = None
        """The prefix cache's host tier (``prefix_cache_cpu_blocks``), if any."""
        if num_host_blocks:
            self.host = HostPrefixTier(self.cpu_pool, num_host_blocks, num_gpu_blocks)
            self.pool.on_evict = self.host.demote
        self.events: KVEventLog | None = None
        """What the prefix cache stored and forgot, once :meth:`record_events` was called."""
        self.queried_tokens = 0
        self.hit_tokens = 0
        """Prompt tokens admitted from the prefix cache, either tier."""

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------

    def _tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(seq.token_ids[index * bs : (index + 1) * bs])

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        hashes = seq.block_hashes
        for index in range(len(hashes), num_blocks):
            parent = hashes[index - 1] if index else 0
            hashes.append(chain_hash(parent, self._tokens(seq, index)))

    def find_cached(self, seq: Sequence, max_blocks: int) -> list[int]:
        """Leading full blocks of ``seq`` whose content the device cache holds."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        # Hashes are computed as the walk reaches them (a miss usually ends it at the
        # first block), and a key is only built to confirm a hash the cache knows.
        hashes = seq.block_hashes
        cached = self.pool.cached
        block_key = self.pool.block_key
        entry = self.pool.entry
        token_ids = seq.token_ids
        bs = self.block_size
        hits: list[int] = []
        parent = NO_PARENT
        for index in range(max_blocks):
            tokens = None
            if index == len(hashes):
                tokens = tuple(token_ids[index * bs : (index + 1) * bs])
                hashes.append(chain_hash(hashes[index - 1] if index else 0, tokens))
            block = cached.get(hashes[index])
            if block is None:
                break
            if tokens is None:
                tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            if block_key[block] != (parent, tokens):
                break
            hits.append(block)
            parent = entry[block]
        return hits

    def find_prefix(self, seq: Sequence) -> list[int]:
        """Prefix hits for admission: always leaves at least one token to compute. None
        for a request that asks for prompt logprobs: every position of its prompt must
        be computed (its blocks still enter the cache for others)."""
        if seq.request.params.prompt_logprobs is not None:
            return []
        if self.digests is not None:
            return self.find_window(seq, (seq.num_tokens - 1) // self.block_size)
        return self.find_cached(seq, (seq.num_tokens - 1) // self.block_size)

    def find_window(self, seq: Sequence, max_blocks: int) -> list[int]:
        """Prefix hits under a sliding window: the longest run of leading blocks whose
        last ones, those the window still reads, are cached; the blocks before them
        come back as :attr:`null_block` entries (released from the start).

        Within a run each block is confirmed by its key (its parent the block before
        it); the run's first block, whose parent may be gone, by the digest of its
        whole prefix (a keyed 128-bit BLAKE2b chain; a wrong hit would need a collision
        of it, as a host-tier hit would)."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        assert self.digests is not None
        hashes = seq.block_hashes
        pool = self.pool
        cached, block_key, entry, digests = pool.cached, pool.block_key, pool.entry, self.digests
        token_ids = seq.token_ids
        bs, window = self.block_size, self.window
        best: list[int] = []
        run: list[int] = []  # the current run of confirmed blocks, ending at index
        for index in range(max_blocks):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            if index == len(hashes):
                hashes.append(chain_hash(hashes[index - 1] if index else 0, tokens))
            block = cached.get(hashes[index])
            if block is None:
                run = []
                continue
            if run and block_key[block] == (entry[run[-1]], tokens):
                run.append(block)
            elif (index == 0 and block_key[block] == (NO_PARENT, tokens)) or (
                index and digests[block] == sequence_digests(seq, index + 1, bs)[index]
            ):
                run = [block]
            else:
                run = []
                continue
            # What the window still reads, and the last block (the next one's parent).
            held_from = min(index, max(0, ((index + 1) * bs - window + 1) // bs))
            if index + 1 - len(run) <= held_from:  # the run covers what the window reads
                best = [self.null_block] * held_from + run[len(run) - (index + 1 - held_from) :]
        return best

    def find_host(self, seq: Sequence, hits: list[int]) -> list[int]:
        """Host-tier blocks holding ``seq``'s blocks after its device ``hits``, in a row
        (the same limits as :meth:`find_prefix`)."""
        if self.host is None or seq.request.params.prompt_logprobs is not None:
            return []
        stop = (seq.num_tokens - 1) // self.block_size
        return self.host.find(seq, len(hits), stop, self.block_size)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, on both tiers (the workers lost their state)."""
        self.pool.reset_prefix_cache()
        if self.host is not None:
            self.host.reset()
        if self.events is not None:
            self.events.cleared()

    def record_events(self) -> KVEventLog:
        """Record from now on what both tiers of the prefix cache store and forget
        (:mod:`scheduler_svc.core.kv_events`); called before anything is cached."""
        if self.pool.cached or (self.host is not None and self.host.num_cached):
            raise RuntimeError("record_events() after blocks were cached")
        self.events = KVEventLog(self.block_size)
        self.pool.events = self.events
        if self.host is not None:
            self.host.events = self.events
            self.pool.on_evict = self._demote
        return self.events

    def _demote(self, block: int) -> None:
        """The pool evicts ``block`` (recording events): the host tier keeps and
        announces it."""
        pool = self.pool
        key = pool.block_key[block]
        assert self.host is not None and key is not None
        if pool.quiet[block]:  # cached without an event: kept without one
            self.host.demote(block)
            return
        self.host.demote(block, (pool.block_hash[block], pool.parent_hash[block], key[1]))  # type: ignore[arg-type]

    def block_hashes_after(self, seq: Sequence, num_tokens: int) -> list[int]:
        """The content hashes of ``seq``'s full blocks past its first ``num_tokens``
        tokens (a prefill's blocks still to compute)."""
        full = len(seq.token_ids) // self.block_size
        if len(seq.block_hashes) < full:
            self._extend_hashes(seq, full)
        return seq.block_hashes[num_tokens // self.block_size : full]

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among ``seq``'s first ``num_tokens`` tokens (all
        known) in the prefix cache."""
        full = num_tokens // self.block_size
        start = seq.num_cached_blocks
        if full <= start:
            return
        hashes = seq.block_hashes
        if len(hashes) < start:
            self._extend_hashes(seq, start)
        table = seq.block_table
        token_ids = seq.token_ids
        bs = self.block_size
        pool = self.pool
        block_hash = pool.block_hash
        cached = pool.cached
        for index in range(start, full):
            # One tuple of the block's tokens serves its chained hash and its key.
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            if index == len(hashes):
                hashes.append(chain_hash(hashes[index - 1] if index else 0, tokens))
            parent = table[index - 1] if index else NO_PARENT
            if index and block_hash[parent] is None:
                # The prefix sits in a private duplicate of cached content: a key naming
                # it could never be reached by a lookup, so the rest stays private too.
                self._extend_hashes(seq, full)
                break
            block = table[index]
            content_hash = hashes[index]
            if content_hash not in cached and block_hash[block] is None:
                pool.cache(
                    block,
                    content_hash,
                    (pool.entry[parent] if index else NO_PARENT, tokens),
                    hashes[index - 1] if index else None,
                )
                if self.host is not None or self.digests is not None:
                    digest = sequence_digests(seq, full, self.block_size)[index]
                    if self.host is not None:
                        self.host.device_digest[block] = digest
                    if self.digests is not None:
                        self.digests[block] = digest
        seq.num_cached_blocks = full

    # -- admission and growth -----------------------------------------------------------

    def _cost(self, num_blocks_after: int, hits: list[int]) -> int:
        """Free-queue blocks consumed by a table of ``num_blocks_after`` starting with ``hits``."""
        ref_cnt, null = self.pool.ref_cnt, self.null_block
        return num_blocks_after - len(hits) + sum(1 for b in hits if b != null and ref_cnt[b] == 0)

    def can_admit(
        self, seq: Sequence, hits: list[int], num_new: int, reserve: int, num_host: int = 0
    ) -> bool:
        """Whether ``seq`` (no blocks yet) can take ``hits``, ``num_host`` blocks copied
        from the host tier and ``num_new`` tokens more."""
        after = self.blocks_for((len(hits) + num_host) * self.block_size + num_new)
        return self._cost(after, hits) + reserve <= self.pool.num_free

    def admit(
        self, seq: Sequence, hits: list[int], host: list[int] | None = None
    ) -> list[tuple[int, int]]:
        """Start ``seq``'s table from its prefix hits, then new blocks for its ``host``
        tier hits (pinned until the step is done); follow with :meth:`append`. Returns
        the (host block, device block) copies. Leading :attr:`null_block` entries of
        ``hits`` (:meth:`find_window`) start released."""
        released = 0
        while released < len(hits) and hits[released] == self.null_block:
            released += 1
        self.pool.share(hits[released:])
        seq.num_released = released
        self.window_hits += bool(released)
        table = list(hits)
        pairs: list[tuple[int, int]] = []
        if host:
            assert self.host is not None
            self.host.pin(host)  # before allocating: a demotion must not take them
            copied = self.pool.allocate(len(host))
            table += copied
            pairs = list(zip(host, copied, strict=True))
            self.host.hit_tokens += len(host) * self.block_size
        seq.block_table = table
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(table) * self.block_size
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_computed_tokens
        if pairs:
            self.cache_full_blocks(seq, seq.num_computed_tokens)
        return pairs

    def _needs_cow(self, seq: Sequence) -> bool:
        computed = seq.num_computed_tokens
        pool = self.pool
        return bool(computed % self.block_size and pool.num_shared) and (
            pool.ref_cnt[seq.block_table[computed // self.block_size]] > 1
        )

    def can_append(self, seq: Sequence, num_new: int, reserve: int = 0) -> bool:
        bs = self.block_size
        computed = seq.num_computed_tokens
        need = -(-(computed + num_new) // bs) - len(seq.block_table)
        if computed % bs and self.pool.num_shared and self._needs_cow(seq):
            need += 1
        return need + reserve <= self.pool.num_free

    def append(self, seq: Sequence, num_new: int) -> tuple[list[int], tuple[CopyOnWrite, ...]]:
        """Make room for ``num_new`` tokens after the computed ones.

        Returns the appended blocks and, when the first written block was shared, the
        copy-on-write that gives ``seq`` its own copy (none: empty).
        """
        table = seq.block_table
        pool = self.pool
        cows: tuple[CopyOnWrite, ...] = ()
        if pool.num_shared and self._needs_cow(seq):
            index = seq.num_computed_tokens // self.block_size
            shared = table[index]
            (private,) = pool.allocate(1)
            pool.release((shared,))
            table[index] = private
            cows = ((index, shared, private),)
        end = seq.num_computed_tokens + num_new
        need = -(-end // self.block_size) - len(table)
        if need > 0:
            appended = pool.allocate(need)
            table.extend(appended)
        else:
            appended = []
        if self.enable_prefix_caching:
            # A block is keyed by its tokens: one ending in a placeholder waits for them.
            known = min(end, len(seq.token_ids))
            if known // self.block_size > seq.num_cached_blocks:
                self.cache_full_blocks(seq, known)
        return appended, cows

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (n>1 samples of one prompt)."""
        child.block_table = list(parent.block_table)
        child.num_released = parent.num_released
        self.pool.share(child.block_table[child.num_released :])
        child.block_hashes = list(parent.block_hashes)
        child.block_digests = list(parent.block_digests)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        """Give back the blocks of ``seq``'s table past its first ``num_blocks`` (they held
        rejected proposals only; none of them is in the prefix cache)."""
        table = seq.block_table
        if len(table) > num_blocks:
            self.pool.release(reversed(table[num_blocks:]))
            del table[num_blocks:]

    def free(self, seq: Sequence) -> None:
        self.pool.release(reversed(seq.block_table[seq.num_released :]))
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_released = 0

    def passed_blocks(self, seq: Sequence) -> range:
        """The blocks of ``seq``, after those released, that no query reads again.

        A query at position p reads keys after p - window, and every query still to come
        sits at or after the computed tokens; a block whose last key is at or before
        computed - window is therefore never read again. With prefix caching the last
        registered block stays (the next block's key names it as its parent)."""
        if not self.window:
            return range(0)
        end = (seq.num_computed_tokens - self.window + 1) // self.block_size
        if self.enable_prefix_caching and end >= seq.num_cached_blocks:
            end = seq.num_cached_blocks - 1
        return range(seq.num_released, end)

    def slide(self, seq: Sequence) -> list[int]:
        """Release the :meth:`passed_blocks` of ``seq``; returns their table indices (now
        naming :attr:`null_block`)."""
        passed = self.passed_blocks(seq)
        if not passed:
            return []
        start, end = passed.start, passed.stop
        table = seq.block_table
        self.pool.release(table[start:end])  # oldest first: the first to be evicted
        table[start:end] = [self.null_block] * (end - start)
        seq.num_released = end
        self.released_blocks += end - start
        return list(range(start, end))

    # -- swap -----------------------------------------------------------------------------

    def num_held(self, seq: Sequence) -> int:
        """Device blocks ``seq`` holds (its table less the released entries)."""
        return len(seq.block_table) - seq.num_released

    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < self.num_held(seq) <= self.cpu_pool.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to the CPU pool; returns (device, cpu) copies. Released
        entries stay released (``num_released`` is kept)."""
        released = seq.num_released
        held = seq.block_table[released:]
        cpu_blocks = self.cpu_pool.allocate(len(held))
        pairs = list(zip(held, cpu_blocks, strict=True))
        self.free(seq)
        seq.num_released = released
        seq.cpu_block_table = cpu_blocks
        return pairs

    def free_swapped(self, seq: Sequence) -> None:
        """Give back a swapped ``seq``'s CPU blocks (it ends, or starts over from its
        tokens): its released entries go with them."""
        self.cpu_pool.release(seq.cpu_block_table)
        seq.cpu_block_table = []
        seq.num_released = 0

    def find_swap_hits(self, seq: Sequence) -> list[int]:
        """Full blocks of a swapped ``seq`` still cached on the device: no copy needed
        (none once it released leading blocks: its CPU blocks start after them)."""
        if seq.num_released:
            return []
        return self.find_cached(seq, seq.num_computed_tokens // self.block_size)

    def can_swap_in(self, seq: Sequence, hits: list[int], num_new: int, reserve: int) -> bool:
        after = self.blocks_for(seq.num_computed_tokens + num_new) - seq.num_released
        return self._cost(after, hits) + reserve <= self.pool.num_free

    def swap_in(self, seq: Sequence, hits: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
        """Give ``seq`` device blocks again; follow with :meth:`append`.

        Returns the (cpu, device) copies and the CPU blocks it no longer needs. Those
        must stay allocated until the copies ran: the caller releases them after the step.
        """
        self.pool.share(hits)
        cpu_blocks = seq.cpu_block_table
        copied = self.pool.allocate(len(cpu_blocks) - len(hits))
        seq.block_table = [self.null_block] * seq.num_released + list(hits) + copied
        # Copies after released entries stay private: a key would name a parent the
        # sequence no longer holds.
        seq.num_cached_blocks = (
            seq.num_computed_tokens // self.block_size if seq.num_released else len(hits)
        )
        seq.cpu_block_table = []
        if self.enable_prefix_caching:
            self.cache_full_blocks(seq, seq.num_computed_tokens)
        return list(zip(cpu_blocks[len(hits) :], copied, strict=True)), cpu_blocks
