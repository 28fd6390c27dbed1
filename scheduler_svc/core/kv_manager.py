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
"""

from __future__ import annotations

from scheduler_svc.core.block_pool import NO_PARENT, CpuBlockPool, DeviceBlockPool, chain_hash
from scheduler_svc.core.host_tier import HostPrefixTier, sequence_digests
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
    ) -> None:
        self.block_size = block_size
        self.pool = DeviceBlockPool(num_gpu_blocks)
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.host: HostPrefixTier | None = None
        """The prefix cache's host tier (``prefix_cache_cpu_blocks``), if any."""
        if num_host_blocks:
            self.host = HostPrefixTier(self.cpu_pool, num_host_blocks, num_gpu_blocks)
            self.pool.on_evict = self.host.demote
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
            parent = block
        return hits

    def find_prefix(self, seq: Sequence) -> list[int]:
        """Prefix hits for admission: always leaves at least one token to compute. None
        for a request that asks for prompt logprobs: every position of its prompt must
        be computed (its blocks still enter the cache for others)."""
        if seq.request.params.prompt_logprobs is not None:
            return []
        return self.find_cached(seq, (seq.num_tokens - 1) // self.block_size)

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
                pool.cache(block, content_hash, (parent, tokens))
                if self.host is not None:
                    digests = sequence_digests(seq, full, self.block_size)
                    self.host.device_digest[block] = digests[index]
        seq.num_cached_blocks = full

    # -- admission and growth -----------------------------------------------------------

    def _cost(self, num_blocks_after: int, hits: list[int]) -> int:
        """Free-queue blocks consumed by a table of ``num_blocks_after`` starting with ``hits``."""
        ref_cnt = self.pool.ref_cnt
        return num_blocks_after - len(hits) + sum(1 for b in hits if ref_cnt[b] == 0)

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
        the (host block, device block) copies."""
        self.pool.share(hits)
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

    def append(self, seq: Sequence, num_new: int) -> tuple[list[int], CopyOnWrite | None]:
        """Make room for ``num_new`` tokens after the computed ones.

        Returns the appended blocks and, when the first written block was shared, the
        copy-on-write that gives ``seq`` its own copy.
        """
        table = seq.block_table
        pool = self.pool
        cow = None
        if pool.num_shared and self._needs_cow(seq):
            index = seq.num_computed_tokens // self.block_size
            shared = table[index]
            (private,) = pool.allocate(1)
            pool.release((shared,))
            table[index] = private
            cow = (index, shared, private)
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
        return appended, cow

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (n>1 samples of one prompt)."""
        child.block_table = list(parent.block_table)
        self.pool.share(child.block_table)
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
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0

    # -- swap -----------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(seq.block_table) <= self.cpu_pool.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to the CPU pool; returns (device, cpu) copies."""
        cpu_blocks = self.cpu_pool.allocate(len(seq.block_table))
        pairs = list(zip(seq.block_table, cpu_blocks, strict=True))
        self.free(seq)
        seq.cpu_block_table = cpu_blocks
        return pairs

    def find_swap_hits(self, seq: Sequence) -> list[int]:
        """Full blocks of a swapped ``seq`` still cached on the device: no copy needed."""
        return self.find_cached(seq, seq.num_computed_tokens // self.block_size)

    def can_swap_in(self, seq: Sequence, hits: list[int], num_new: int, reserve: int) -> bool:
        after = self.blocks_for(seq.num_computed_tokens + num_new)
        return self._cost(after, hits) + reserve <= self.pool.num_free

    def swap_in(self, seq: Sequence, hits: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
        """Give ``seq`` device blocks again; follow with :meth:`append`.

        Returns the (cpu, device) copies and the CPU blocks it no longer needs. Those
        must stay allocated until the copies ran: the caller releases them after the step.
        """
        self.pool.share(hits)
        cpu_blocks = seq.cpu_block_table
        copied = self.pool.allocate(len(cpu_blocks) - len(hits))
        seq.block_table = list(hits) + copied
        seq.num_cached_blocks = len(hits)
        seq.cpu_block_table = []
        if self.enable_prefix_caching:
            self.cache_full_blocks(seq, seq.num_computed_tokens)
        return list(zip(cpu_blocks[len(hits) :], copied, strict=True)), cpu_blocks
