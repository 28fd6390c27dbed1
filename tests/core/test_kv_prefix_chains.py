"""Prefix-cache hash chains of a sequence whose blocks duplicate content another
sequence cached first: two requests with one long prompt, prefilled in chunks side by
side. The later one's duplicate blocks stay private, yet its chain of block hashes must
stay exact, so that its K/V are found again after a swap (and it keeps growing).

Driven on the KVCacheManager directly, in the order the scheduler calls it.
"""

from __future__ import annotations

from support.kv_cases import BS, decode, expected_refs, make_kv, make_seq

from scheduler_svc.core.block_pool import NO_PARENT, chain_hash
from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.request import Sequence

PROMPT = list(range(500, 524))  # 6 blocks


def chunk(kv: KVCacheManager, seq: Sequence, num_new: int) -> None:
    """Compute the next ``num_new`` known tokens of ``seq`` (one prefill chunk)."""
    kv.append(seq, num_new)
    seq.num_computed_tokens += num_new


def chain(tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    for index in range(len(tokens) // BS):
        parent = hashes[-1] if hashes else 0
        hashes.append(chain_hash(parent, tuple(tokens[index * BS : (index + 1) * BS])))
    return hashes


def test_duplicate_blocks_computed_in_one_chunk_keep_an_exact_hash_chain() -> None:
    kv = make_kv(num_gpu_blocks=16, num_cpu_blocks=16)
    first = make_seq(PROMPT)
    kv.admit(first, kv.find_prefix(first))
    chunk(kv, first, 8)  # blocks 0-1, cached by "first"

    second = make_seq(PROMPT)
    hits = kv.find_prefix(second)
    assert hits == first.block_table  # the two blocks "first" cached
    kv.admit(second, hits)
    chunk(kv, second, 16)  # blocks 2-5, cached by "second"

    chunk(kv, first, 16)  # blocks 2-5 again: duplicates of what "second" cached
    private = first.block_table[2:]
    assert all(kv.pool.block_hash[b] is None for b in private)
    assert first.block_hashes == chain(PROMPT)
    for token in (1, 2, 3, 4):  # "first" goes on into block 6
        decode(kv, first, token)
    assert first.block_hashes == chain([*PROMPT, 1, 2, 3, 4])
    assert kv.pool.check(expected_refs(kv, first, second)) == []

    # Swapped out and back: every full block whose content the cache holds is found
    # through the chain, the private duplicates' content included.
    kv.swap_out(first)
    hits = kv.find_swap_hits(first)
    assert hits == second.block_table
    assert kv.pool.block_key[hits[2]] == (kv.pool.entry[hits[1]], tuple(PROMPT[8:12]))
    assert kv.pool.block_key[hits[0]] == (NO_PARENT, tuple(PROMPT[:4]))


def test_a_hash_collision_costs_the_hit_never_the_kv() -> None:
    # A block registered under the hash of the second block of PROMPT but holding other
    # content (what a hash collision would do): the walk confirms each block's key, so
    # it stops there and keeps the hit before it.
    kv = make_kv(num_gpu_blocks=16)
    first = make_seq(PROMPT)
    kv.admit(first, kv.find_prefix(first))
    chunk(kv, first, BS)  # block 0 cached
    (impostor,) = kv.pool.allocate(1)
    hashes = chain(PROMPT)
    kv.pool.cache(impostor, hashes[1], (kv.pool.entry[first.block_table[0]], (9, 9, 9, 9)))
    second = make_seq(PROMPT)
    assert kv.find_prefix(second) == first.block_table[:1]
    third = make_seq([1, 2, 3, 4, *PROMPT[4:]])  # another first block, same second
    kv.pool.cache(kv.pool.allocate(1)[0], chain([1, 2, 3, 4])[0], (NO_PARENT, (0, 0, 0, 0)))
    assert kv.find_prefix(third) == []


def test_prefix_statistics_add_up_over_admissions() -> None:
    kv = make_kv(num_gpu_blocks=32)
    first = make_seq(PROMPT)
    kv.admit(first, kv.find_prefix(first))
    chunk(kv, first, len(PROMPT))
    for _ in range(2):
        again = make_seq(PROMPT)
        kv.admit(again, kv.find_prefix(again))  # 5 of 6 blocks hit
        chunk(kv, again, len(PROMPT) - again.num_computed_tokens)
    assert kv.queried_tokens == 3 * len(PROMPT)
    assert kv.hit_tokens == 2 * 5 * BS


def test_a_key_never_names_a_parent_evicted_and_cached_again() -> None:
    # A child's key names its parent's cache entry, not the block: once the parent is
    # evicted and its block caches other content, the child no longer continues it,
    # even under that content's hash (what a collision would look like).
    kv = make_kv(num_gpu_blocks=4)
    first = make_seq(PROMPT[:8])
    kv.admit(first, kv.find_prefix(first))
    chunk(kv, first, 8)  # blocks 0, 1 cached
    parent, child = first.block_table
    kv.pool.release([parent])  # the parent alone goes back (a slid window's release)
    first.block_table = [child]
    assert parent in kv.pool.allocate(kv.pool.num_free)  # evicted on the way
    assert kv.pool.block_hash[parent] is None
    other = (7, 7, 7, 7)
    kv.pool.cache(parent, chain(list(other))[0], (NO_PARENT, other))
    hashes = chain([*other, *PROMPT[4:8]])
    kv.pool.cached[hashes[1]] = child  # the collision: the child under the new chain's hash
    kv.pool.block_hash[child] = hashes[1]
    assert kv.find_prefix(make_seq([*other, *PROMPT[4:8], 5])) == [parent]
