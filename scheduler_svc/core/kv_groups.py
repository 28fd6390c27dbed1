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
previous block of the same group). A hit is a run of leading logical blocks whose full
groups' blocks are all cached and whose windowed groups' blocks are cached as far back
as the window reads (:meth:`find_window`, as ``KVCacheManager.find_window`` for one
windowed table), so a long prompt whose early windowed blocks were released and evicted
still hits in full. Only the first group's blocks are announced as KV events (routers
see the content once).

The host tier keeps each group's evicted blocks apart (a group's digest of the prefix),
and a hit there is a run of logical blocks it holds every group's block of, after the
device hits. Not here: swapped sequences' device hits.
"""

from __future__ import annotations

from scheduler_svc.core.block_pool import NO_PARENT, chain_hash
from scheduler_svc.core.host_tier import sequence_digests
from scheduler_svc.core.kv_manager import CopyOnWrite, KVCacheManager
from scheduler_svc.core.request import Sequence

GroupHits = list[tuple[int, ...]]
"""Prefix hits of a grouped table: per logical block, its groups' cached blocks."""


def group_hash(content_hash: int, group: int) -> int:
    """The prefix-cache hash of group ``group``'s block of that content (the first
    group's is the content hash itself, as a single table's)."""
    return content_hash if group == 0 else hash((content_hash, -1 - group))


def group_digest(digest: bytes, group: int) -> bytes:
    """The host tier's key of group ``group``'s block of a prefix with that digest."""
    return digest if group == 0 else digest + group.to_bytes(2, "little")


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
        num_host_blocks: int = 0,
    ) -> None:
        """``groups``: each group's window (0: its layers read the whole context), at
        least two; ``release``: give back the windowed groups' blocks behind the window;
        ``num_host_blocks``: the prefix cache's host tier (blocks of one group each)."""
        if len(groups) < 2 or any(w < 0 for w in groups):
            raise ValueError(f"kv_groups {list(groups)}: at least two windows, none negative")
        windows = [w for w in groups if w]
        super().__init__(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
            window=max(windows) if windows and release else 0,
        )
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
        """Prefix hits for admission (at least one token left to compute; none for a
        request that asks for prompt logprobs): with windows, :meth:`find_window`."""
        if seq.request.params.prompt_logprobs is not None:
            return []
        if self.digests is not None:
            return self.find_window(seq, (seq.num_tokens - 1) // self.block_size)
        return self.find_cached(seq, (seq.num_tokens - 1) // self.block_size)

    def find_window(self, seq: Sequence, max_blocks: int) -> GroupHits:  # type: ignore[override]
        """Prefix hits when the windowed groups release: the longest run of leading
        logical blocks whose full groups' blocks are all cached and whose windowed
        groups' blocks are cached as far back as the window reads (their entries
        before that come back as :attr:`null_block`, released from the start).

        A full group's block is confirmed by its key (its group's previous block); a
        windowed group's by its key within a run of cached blocks, the run's first one,
        whose previous block may be gone, by its group's digest of the whole prefix
        (as ``KVCacheManager.find_window`` confirms it)."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        assert self.digests is not None
        hashes, token_ids, bs, window = (
            seq.block_hashes,
            seq.token_ids,
            self.block_size,
            self.window,
        )
        pool, digests, null = self.pool, self.digests, self.null_block
        cached, block_key, entry = pool.cached, pool.block_key, pool.entry
        windowed = set(self.windowed)
        full = [g for g in range(self.num_groups) if g not in windowed]
        parents = {g: first_parent(g) for g in full}
        runs: dict[int, list[int]] = {g: [] for g in windowed}  # each ending at index
        chain: list[list[int]] = []  # the full groups' blocks, per logical block
        best: GroupHits = []
        for index in range(max_blocks):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            if index == len(hashes):
                hashes.append(chain_hash(hashes[index - 1] if index else 0, tokens))
            blocks = []
            for g in full:
                block = cached.get(group_hash(hashes[index], g))
                if block is None or block_key[block] != (parents[g], tokens):
                    return best
                blocks.append(block)
            parents = {g: entry[b] for g, b in zip(full, blocks, strict=True)}
            chain.append(blocks)
            for g in windowed:
                run = runs[g]
                block = cached.get(group_hash(hashes[index], g))
                if block is None:
                    run.clear()
                elif run and block_key[block] == (entry[run[-1]], tokens):
                    run.append(block)
                elif (index == 0 and block_key[block] == (first_parent(g), tokens)) or (
                    index
                    and digests[block]
                    == group_digest(sequence_digests(seq, index + 1, bs)[index], g)
                ):
                    runs[g] = [block]
                else:
                    run.clear()
            # What the window still reads, and the last block (the next one's parent).
            held_from = min(index, max(0, ((index + 1) * bs - window + 1) // bs))
            if all(index + 1 - len(runs[g]) <= held_from for g in windowed):
                best = []
                for i in range(index + 1):
                    row = dict(zip(full, chain[i], strict=True))
                    for g in windowed:
                        row[g] = null if i < held_from else runs[g][len(runs[g]) - (index + 1 - i)]
                    best.append(tuple(row[g] for g in range(self.num_groups)))
        return best

    def find_host(self, seq: Sequence, hits: list) -> GroupHits:  # type: ignore[override,type-arg]
        """Host-tier blocks of ``seq``'s logical blocks after its device ``hits``, in a
        row: every full group's, and with windows the windowed groups' as far back as
        the window of the whole hit reads (None before that: released)."""
        host = self.host
        if host is None or not host.cached or seq.request.params.prompt_logprobs is not None:
            return []
        start, stop, bs = len(hits), (seq.num_tokens - 1) // self.block_size, self.block_size
        windowed = set(self.windowed)
        rows: list[list[int | None]] = []
        missing = -1  # the last block a windowed group's block of is not in the tier
        best: GroupHits = []
        for index in range(start, stop):
            digest = sequence_digests(seq, index + 1, bs)[index]
            row = [host.cached.get(group_digest(digest, g)) for g in range(self.num_groups)]
            if any(row[g] is None for g in range(self.num_groups) if g not in windowed):
                break
            if any(row[g] is None for g in windowed):
                missing = index
            rows.append(row)
            if missing < max(start, self._held_from(index + 1)):
                best = self._released_before(rows, start, index + 1, None)
        return best

    def _held_from(self, num_blocks: int) -> int:
        """The first logical block a query after ``num_blocks`` full blocks reads (the
        window's first), or ``num_blocks - 1`` (the last stays: the next one's parent);
        0 without windows."""
        if not self.windowed:
            return 0
        return min(
            num_blocks - 1,
            max(0, (num_blocks * self.block_size - self.window + 1) // self.block_size),
        )

    def _released_before(
        self, rows: list[list[int | None]], start: int, end: int, released: int | None
    ) -> GroupHits:
        """``rows`` (logical blocks ``start`` on) up to ``end``, the windowed groups'
        entries before the window of ``end`` blocks marked ``released`` (the null block
        in device rows; None in host-tier rows, whose numbers are the CPU pool's)."""
        held_from, windowed = self._held_from(end), self.windowed
        out = []
        for index, row in enumerate(rows[: end - start], start=start):
            entries = list(row)
            if index < held_from:
                for g in windowed:
                    entries[g] = released
            out.append(tuple(entries))
        return out  # type: ignore[return-value]

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
        block_hash, entry, null, host = pool.block_hash, pool.entry, self.null_block, self.host
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
            digest = (
                sequence_digests(seq, full, bs)[index]
                if host is not None or self.digests is not None
                else None
            )
            for g in range(num_groups):
                if table[base + g] == null:  # released (a host hit's, before the window)
                    continue
                parent = entry[table[base - num_groups + g]] if index else first_parent(g)
                pool.cache(
                    table[base + g],
                    group_hash(hashes[index], g),
                    (parent, tokens),
                    None if parent_hash is None else group_hash(parent_hash, g),
                    announce=g == 0,
                )
                if digest is not None and block_hash[table[base + g]] is not None:
                    key = group_digest(digest, g)
                    if host is not None:
                        host.device_digest[table[base + g]] = key
                    if self.digests is not None:
                        self.digests[table[base + g]] = key
        seq.num_cached_blocks = full

    # -- admission and growth -------------------------------------------------------------

    def _cost(self, num_blocks_after: int, hits: GroupHits) -> int:  # type: ignore[override]
        ref_cnt, null = self.pool.ref_cnt, self.null_block
        reused = sum(1 for blocks in hits for b in blocks if b != null and ref_cnt[b] == 0)
        return (num_blocks_after - len(hits)) * self.num_groups + reused

    def admit(  # type: ignore[override]
        self, seq: Sequence, hits: GroupHits, host: GroupHits | None = None
    ) -> list[tuple[int, int]]:
        """Start ``seq``'s table from its prefix hits, then new blocks for its ``host``
        tier hits (pinned until the step is done); returns the (tier block, device
        block) copies."""
        null, host = self.null_block, host or []
        # The windowed groups' entries before the window of the whole hit are released
        # (device hits past find_window's own, when host hits follow them).
        rows = self._released_before([list(row) for row in hits], 0, len(hits) + len(host), null)
        table = [b for row in rows for b in row]
        self.pool.share(b for b in table if b != null)
        # Leading rows: device rows naming the null block, then host rows with None.
        released = sum(1 for row in rows if null in row) + sum(1 for row in host if None in row)
        self.window_hits += bool(released)
        pairs: list[tuple[int, int]] = []
        if host:
            assert self.host is not None
            tier = [b for row in host for b in row if b is not None]
            self.host.pin(tier)  # before allocating: a demotion must not take them
            copied = self.pool.allocate(len(tier))
            fill = iter(copied)
            table += [null if b is None else next(fill) for row in host for b in row]
            pairs = list(zip(tier, copied, strict=True))
            self.host.hit_tokens += len(host) * self.block_size
        seq.block_table = table
        seq.num_released = released
        seq.released_width = len(self.windowed)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = (len(hits) + len(host)) * self.block_size
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_computed_tokens
        if pairs:
            self.cache_full_blocks(seq, seq.num_computed_tokens)
        return pairs

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
        child.block_digests = list(parent.block_digests)
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
        """Release the windowed groups' blocks of ``seq``'s :meth:`passed_blocks` (the
        full-attention groups keep theirs); returns the released table entries (now
        naming :attr:`null_block`)."""
        passed = self.passed_blocks(seq)
        if not passed:
            return []
        table, num_groups, null = seq.block_table, self.num_groups, self.null_block
        entries = [i * num_groups + g for i in passed for g in self.windowed]
        self.pool.release(table[i] for i in entries)
        for i in entries:
            table[i] = null
        seq.num_released = passed.stop
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
