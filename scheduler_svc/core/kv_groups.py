"""KV blocks per layer group: models that mix sliding-window and full-attention layers.

A model whose layers all read the whole context, or all a sliding window, keeps one
block table per sequence (:class:`~scheduler_svc.core.kv_manager.KVCacheManager`). A
model that mixes them (gemma2, gemma3, qwen2 with ``max_window_layers``) would hold, in
every windowed layer, the whole context its window no longer reads. Here the workers
lay their cache out in layer groups instead (``WorkerHello.kv_groups``: a window per
group, 0 for a group of full-attention layers), every group the same number of layers,
so that one pool of equal blocks serves them all (the shape of vLLM's hybrid KV cache
manager). A device block then holds ``block_size`` tokens of one group's layers.

A sequence's table holds its groups' blocks side by side: logical block ``i`` (tokens
``i * block_size`` on) of group ``g`` is entry ``i * G + g`` (``G`` groups), so the
wire protocol, swap, copy-on-write and the workers' table updates are those of a single
table. The windowed groups' entries are released as the window passes them
(:meth:`slide`; they then name the null block, as with one windowed table), the
full-attention groups' never. Every group's blocks of a full logical block enter the
prefix cache together (each group's under a hash of its own, its key naming the
previous block of the same group), and a hit takes a run of logical blocks whose every
group is cached, from the first: a group's block released and evicted ends the run
there. Only the first group's blocks are announced as KV events (routers see the
content once).

Not here: the host tier of the prefix cache (off for grouped tables), hits that take
only the blocks a window reads (``KVCacheManager.find_window``), and swapped sequences'
device hits.
"""

from __future__ import annotations

from scheduler_svc.core.block_pool import NO_PARENT, chain_hash
from scheduler_svc.core.kv_manager import CopyOnWrite, KVCacheManager
from scheduler_svc.core.request import Sequence

GroupHits = list[tuple[int, ...]]
"""Prefix hits of a grouped table: per logical block, its groups' cached blocks."""


def group_hash(content_hash: int, group: int) -> int:
    """The prefix-cache hash of group ``group``'s block of that content (the first
    group's is the content hash itself, as a single table's)."""
    return content_hash if group == 0 else hash((content_hash, -1 - group))


def first_parent(group: int) -> int:
    """The parent a group's first block names in its key (one per group, so no key of
    one group matches a block of another)."""
    return NO_PARENT - group


class GroupedKVCacheManager(KVCacheManager):
    def __init__(
        self,
        *,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        enable_prefix_caching: bool,
        groups: tuple[int, ...],
        release: bool = True,
    ) -> None:
        """``groups``: each group's window (0: its layers read the whole context), at
        least two; ``release``: give back the windowed groups' blocks behind the window."""
        if len(groups) < 2 or any(w < 0 for w in groups):
            raise ValueError(f"kv_groups {list(groups)}: at least two windows, none negative")
        windows = [w for w in groups if w]
        super().__init__(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            window=max(windows) if windows and release else 0,
        )
        self.digests = None  # no window-only hits
        self.groups = groups
        self.num_groups = len(groups)
        self.windowed = tuple(g for g, w in enumerate(groups) if w) if self.window else ()
        """The groups whose blocks :meth:`slide` gives back (the largest window
        decides when, for all of them)."""

    # -- prefix cache -------------------------------------------------------------------

    def find_cached(self, seq: Sequence, max_blocks: int) -> GroupHits:  # type: ignore[override]
        """Leading logical blocks of ``seq`` whose every group's block the device cache
        holds (each confirmed by its key: its tokens and its group's previous block)."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        hashes, token_ids, bs, num_groups = (
            seq.block_hashes,
            seq.token_ids,
            self.block_size,
            self.num_groups,
        )
        pool = self.pool
        cached, block_key, entry = pool.cached, pool.block_key, pool.entry
        parents = [first_parent(g) for g in range(num_groups)]
        hits: GroupHits = []
        for index in range(max_blocks):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            if index == len(hashes):
                hashes.append(chain_hash(hashes[index - 1] if index else 0, tokens))
            blocks = []
            for g in range(num_groups):
                block = cached.get(group_hash(hashes[index], g))
                if block is None or block_key[block] != (parents[g], tokens):
                    return hits
                blocks.append(block)
            parents = [entry[b] for b in blocks]
            hits.append(tuple(blocks))
        return hits

    def find_prefix(self, seq: Sequence) -> GroupHits:  # type: ignore[override]
        if seq.request.params.prompt_logprobs is not None:
            return []
        return self.find_cached(seq, (seq.num_tokens - 1) // self.block_size)

    def find_host(self, seq: Sequence, hits: list) -> list[int]:  # type: ignore[type-arg]
        return []

    def find_swap_hits(self, seq: Sequence) -> list[int]:
        return []

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full logical blocks among ``seq``'s first ``num_tokens`` tokens,
        every group's block of each; stops at one whose previous block in some group is
        a private copy (no key could reach past it)."""
        full = num_tokens // self.block_size
        start = seq.num_cached_blocks
        if full <= start:
            return
        hashes = seq.block_hashes
        if len(hashes) < start:
            self._extend_hashes(seq, start)
        table, token_ids, bs, num_groups = (
            seq.block_table,
            seq.token_ids,
            self.block_size,
            self.num_groups,
        )
        pool = self.pool
        block_hash, entry, null = pool.block_hash, pool.entry, self.null_block
        for index in range(start, full):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            if index == len(hashes):
                hashes.append(chain_hash(hashes[index - 1] if index else 0, tokens))
            base = index * num_groups
            if index and any(
                b == null or block_hash[b] is None for b in table[base - num_groups : base]
            ):  # a private copy (or a released block) before it: no key reaches past
                self._extend_hashes(seq, full)
                break
            parent_hash = hashes[index - 1] if index else None
            for g in range(num_groups):
                parent = entry[table[base - num_groups + g]] if index else first_parent(g)
                pool.cache(
                    table[base + g],
                    group_hash(hashes[index], g),
                    (parent, tokens),
                    None if parent_hash is None else group_hash(parent_hash, g),
                    announce=g == 0,
                )
        seq.num_cached_blocks = full

    # -- admission and growth -------------------------------------------------------------

    def _cost(self, num_blocks_after: int, hits: GroupHits) -> int:  # type: ignore[override]
        ref_cnt = self.pool.ref_cnt
        reused = sum(1 for blocks in hits for b in blocks if ref_cnt[b] == 0)
        return (num_blocks_after - len(hits)) * self.num_groups + reused

    def admit(  # type: ignore[override]
        self, seq: Sequence, hits: GroupHits, host: list[int] | None = None
    ) -> list[tuple[int, int]]:
        table = [b for blocks in hits for b in blocks]
        self.pool.share(table)
        seq.block_table = table
        seq.num_released = 0
        seq.released_width = len(self.windowed)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_computed_tokens
        return []

    def _shared_entries(self, seq: Sequence) -> list[int]:
        """Entries of ``seq``'s partial last logical block whose blocks are shared (the
        next token writes them: each needs a private copy)."""
        computed = seq.num_computed_tokens
        pool = self.pool
        if not (computed % self.block_size and pool.num_shared):
            return []
        first = computed // self.block_size * self.num_groups
        table, ref_cnt = seq.block_table, pool.ref_cnt
        return [i for i in range(first, first + self.num_groups) if ref_cnt[table[i]] > 1]

    def can_append(self, seq: Sequence, num_new: int, reserve: int = 0) -> bool:
        after = self.blocks_for(seq.num_computed_tokens + num_new) * self.num_groups
        need = after - len(seq.block_table) + len(self._shared_entries(seq))
        return need + reserve <= self.pool.num_free

    def append(self, seq: Sequence, num_new: int) -> tuple[list[int], tuple[CopyOnWrite, ...]]:
        table, pool = seq.block_table, self.pool
        cows = []
        for index in self._shared_entries(seq):
            shared = table[index]
            (private,) = pool.allocate(1)
            pool.release((shared,))
            table[index] = private
            cows.append((index, shared, private))
        end = seq.num_computed_tokens + num_new
        need = self.blocks_for(end) * self.num_groups - len(table)
        appended = pool.allocate(need) if need > 0 else []
        table.extend(appended)
        if self.enable_prefix_caching:
            known = min(end, len(seq.token_ids))
            if known // self.block_size > seq.num_cached_blocks:
                self.cache_full_blocks(seq, known)
        return appended, tuple(cows)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        child.num_released = parent.num_released
        child.released_width = parent.released_width
        self.pool.share(self._held(parent))
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        table = seq.block_table
        keep = num_blocks * self.num_groups
        if len(table) > keep:
            self.pool.release(reversed(table[keep:]))
            del table[keep:]

    def _held(self, seq: Sequence) -> list[int]:
        null = self.null_block
        return [b for b in seq.block_table if b != null]

    def num_held(self, seq: Sequence) -> int:
        return len(seq.block_table) - seq.num_released * len(self.windowed)

    def free(self, seq: Sequence) -> None:
        self.pool.release(reversed(self._held(seq)))
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_released = 0

    def slide(self, seq: Sequence) -> list[int]:
        """Release the windowed groups' blocks of ``seq``'s leading logical blocks that no
        query reads again (the full-attention groups keep theirs); returns the released
        table entries (now naming :attr:`null_block`). With prefix caching the last
        registered logical block stays whole (the next one's keys name its blocks)."""
        window = self.window
        if not window:
            return []
        end = (seq.num_computed_tokens - window + 1) // self.block_size
        if self.enable_prefix_caching and end >= seq.num_cached_blocks:
            end = seq.num_cached_blocks - 1
        start = seq.num_released
        if end <= start:
            return []
        table, num_groups, null = seq.block_table, self.num_groups, self.null_block
        entries = [i * num_groups + g for i in range(start, end) for g in self.windowed]
        self.pool.release(table[i] for i in entries)
        for i in entries:
            table[i] = null
        seq.num_released = end
        self.released_blocks += len(entries)
        return entries

    # -- swap -----------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < self.num_held(seq) <= self.cpu_pool.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s held blocks to the CPU pool, in table order; released entries
        stay released."""
        released = seq.num_released
        held = self._held(seq)
        cpu_blocks = self.cpu_pool.allocate(len(held))
        self.free(seq)
        seq.num_released = released
        seq.cpu_block_table = cpu_blocks
        return list(zip(held, cpu_blocks, strict=True))

    def can_swap_in(self, seq: Sequence, hits: list, num_new: int, reserve: int) -> bool:  # type: ignore[type-arg]
        after = self.blocks_for(seq.num_computed_tokens + num_new) * self.num_groups
        need = after - seq.num_released * len(self.windowed)
        return need + reserve <= self.pool.num_free

    def swap_in(  # type: ignore[override]
        self, seq: Sequence, hits: list
    ) -> tuple[list[tuple[int, int]], list[int]]:
        cpu_blocks = seq.cpu_block_table
        copied = self.pool.allocate(len(cpu_blocks))
        table, fill = [], iter(copied)
        released, windowed, null = seq.num_released, set(self.windowed), self.null_block
        for i in range(len(cpu_blocks) + released * len(windowed)):
            index, group = divmod(i, self.num_groups)
            table.append(null if index < released and group in windowed else next(fill))
        seq.block_table = table
        seq.released_width = len(self.windowed)
        # Copies after released entries stay private (their keys would name blocks the
        # sequence no longer holds); without releases they enter the cache again.
        seq.num_cached_blocks = seq.num_computed_tokens // self.block_size if released else 0
        seq.cpu_block_table = []
        if self.enable_prefix_caching:
            self.cache_full_blocks(seq, seq.num_computed_tokens)
        return list(zip(cpu_blocks, copied, strict=True)), cpu_blocks
