"""KVCacheManager: prefix hits, admission cost, growth, copy-on-write, swap."""

from __future__ import annotations

import pytest
from support.kv_cases import BS, decode, expected_refs, make_child, make_kv, make_seq, prefill

PROMPT10 = list(range(100, 110))
PROMPT12 = list(range(200, 212))


def test_blocks_for_rounds_up() -> None:
    kv = make_kv()
    assert [kv.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_first_sequence_has_no_prefix_hit() -> None:
    kv = make_kv()
    seq = make_seq(PROMPT10)
    assert kv.find_prefix(seq) == []


def test_find_prefix_reuses_the_full_blocks_of_an_identical_prompt() -> None:
    kv = make_kv()
    first = make_seq(PROMPT10)
    prefill(kv, first)
    assert len(first.block_table) == 3
    second = make_seq(PROMPT10)
    hits = kv.find_prefix(second)
    assert hits == first.block_table[: (10 - 1) // BS]
    assert len(hits) == 2

    kv.admit(second, hits)
    assert second.num_computed_tokens == 8
    assert second.block_table == hits
    assert second.num_cached_blocks == 2
    assert kv.pool.ref_cnt[hits[0]] == 2
    assert kv.pool.ref_cnt[hits[1]] == 2
    assert kv.hit_tokens == 8
    assert kv.queried_tokens == 20


def test_find_prefix_never_covers_the_whole_prompt() -> None:
    kv = make_kv()
    first = make_seq(PROMPT12)
    prefill(kv, first)
    assert kv.pool.num_cached_free == 0
    assert len(kv.pool.cached) == 3  # all three full blocks are cached
    second = make_seq(PROMPT12)
    hits = kv.find_prefix(second)
    assert len(hits) == (12 - 1) // BS == 2
    assert hits == first.block_table[:2]
    # The cache does hold the third block; find_prefix leaves it to be computed.
    assert kv.find_cached(second, 3) == first.block_table


def test_a_prompt_of_one_block_or_less_gets_no_hit() -> None:
    kv = make_kv()
    prefill(kv, make_seq([1, 2, 3, 4]))
    assert kv.find_prefix(make_seq([1, 2, 3, 4])) == []


def test_hits_stop_at_the_first_differing_block() -> None:
    kv = make_kv()
    first = make_seq(PROMPT12 + [1, 2, 3, 4])
    prefill(kv, first)
    other = make_seq(PROMPT12[:4] + [0, 0, 0, 0] + PROMPT12[8:] + [1, 2, 3, 4])
    assert kv.find_prefix(other) == first.block_table[:1]


def test_hits_are_chained_to_the_blocks_before() -> None:
    kv = make_kv()
    first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(kv, first)
    # Same second block, different first block: the second block must not hit.
    other = make_seq([0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert kv.find_prefix(other) == []


def test_freed_blocks_stay_cached_until_evicted() -> None:
    kv = make_kv(num_gpu_blocks=4)
    first = make_seq(PROMPT10)
    prefill(kv, first)
    table = list(first.block_table)
    kv.free(first)
    assert first.block_table == []
    assert kv.pool.num_free == 4
    assert kv.find_prefix(make_seq(PROMPT10)) == table[:2]
    kv.pool.allocate(4)  # evicts everything
    assert kv.find_prefix(make_seq(PROMPT10)) == []


def test_free_releases_the_tail_first() -> None:
    kv = make_kv(num_gpu_blocks=4)
    seq = make_seq(PROMPT10)
    prefill(kv, seq)
    table = list(seq.block_table)
    kv.free(seq)
    assert list(kv.pool.free_queue)[-3:] == table[::-1]


def test_can_admit_counts_hit_blocks_sitting_in_the_free_queue() -> None:
    kv = make_kv(num_gpu_blocks=4)
    first = make_seq(PROMPT12)
    prefill(kv, first)
    kv.free(first)  # all 4 blocks free, 3 of them cached
    second = make_seq(PROMPT12)
    hits = kv.find_prefix(second)
    assert len(hits) == 2
    # 3 blocks after admission, 2 of them hits that leave the free queue: costs 3.
    assert kv.can_admit(second, hits, 4, reserve=1)
    assert not kv.can_admit(second, hits, 4, reserve=2)


def test_can_admit_does_not_charge_hits_held_by_a_running_sequence() -> None:
    kv = make_kv(num_gpu_blocks=4)
    first = make_seq(PROMPT12)
    prefill(kv, first)  # holds 3 blocks, 1 free
    second = make_seq(PROMPT12)
    hits = kv.find_prefix(second)
    # Only the one new block costs a free block.
    assert kv.can_admit(second, hits, 4, reserve=0)
    assert not kv.can_admit(second, hits, 4, reserve=1)
    assert not kv.can_admit(second, [], 12, reserve=0)


def test_append_allocates_exactly_the_blocks_needed() -> None:
    kv = make_kv(num_gpu_blocks=8)
    seq = make_seq(list(range(1, 11)))
    kv.admit(seq, [])
    appended, cows = kv.append(seq, 5)  # a first chunk of 5 tokens
    assert len(appended) == 2
    assert cows == ()
    assert seq.block_table == appended
    seq.num_computed_tokens = 5
    appended, _ = kv.append(seq, 3)  # fills block 1 exactly
    assert appended == []
    seq.num_computed_tokens = 8
    appended, _ = kv.append(seq, 2)
    assert len(appended) == 1
    seq.num_computed_tokens = 10
    assert len(seq.block_table) == 3
    assert kv.pool.num_free == 5
    assert kv.pool.check(expected_refs(kv, seq)) == []
    # Decodes: a new block exactly when the next token starts one.
    assert decode(kv, seq, 11)[0] == []
    assert decode(kv, seq, 12)[0] == []
    assert len(decode(kv, seq, 13)[0]) == 1
    assert len(seq.block_table) == 4


def test_append_registers_full_blocks_in_the_cache() -> None:
    kv = make_kv()
    seq = make_seq(list(range(1, 11)))
    kv.admit(seq, [])
    kv.append(seq, 5)
    assert seq.num_cached_blocks == 1
    assert len(kv.pool.cached) == 1
    seq.num_computed_tokens = 5
    kv.append(seq, 5)
    assert seq.num_cached_blocks == 2
    assert len(kv.pool.cached) == 2


def test_can_append_refuses_when_the_pool_is_short() -> None:
    kv = make_kv(num_gpu_blocks=2)
    seq = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    prefill(kv, seq)
    seq.token_ids.append(9)
    assert not kv.can_append(seq, 1)
    seq2 = make_seq([1, 2, 3])
    kv2 = make_kv(num_gpu_blocks=2)
    prefill(kv2, seq2)
    seq2.token_ids.append(4)
    assert kv2.can_append(seq2, 1)  # fits the current block
    assert kv2.can_append(seq2, 1, reserve=1)
    assert not kv2.can_append(seq2, 1, reserve=2)


def test_fork_shares_every_block() -> None:
    kv = make_kv()
    parent = make_seq([1, 2, 3, 4, 5, 6], n=2)
    prefill(kv, parent)
    child = make_child(parent, 1)
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    assert child.num_computed_tokens == 6
    assert all(kv.pool.ref_cnt[b] == 2 for b in parent.block_table)
    assert kv.pool.check(expected_refs(kv, parent, child)) == []


def test_copy_on_write_on_a_shared_partial_last_block() -> None:
    kv = make_kv()
    parent = make_seq([1, 2, 3, 4, 5, 6], n=2)
    prefill(kv, parent)
    child = make_child(parent, 1)
    kv.fork(parent, child)
    full, partial = parent.block_table
    parent.token_ids.append(50)
    child.token_ids.append(60)

    assert kv.can_append(parent, 1, reserve=kv.pool.num_free - 1)
    assert not kv.can_append(parent, 1, reserve=kv.pool.num_free)
    appended, cows = kv.append(parent, 1)
    assert appended == []
    ((index, source, private),) = cows
    assert (index, source) == (1, partial)
    assert private not in (full, partial)
    assert parent.block_table == [full, private]
    assert kv.pool.ref_cnt[partial] == 1
    assert kv.pool.ref_cnt[private] == 1
    assert kv.pool.ref_cnt[full] == 2

    # The last holder writes in place.
    appended, cows = kv.append(child, 1)
    assert (appended, cows) == ([], ())
    assert child.block_table == [full, partial]
    assert kv.pool.check(expected_refs(kv, parent, child)) == []


def test_copy_on_write_with_three_samples() -> None:
    kv = make_kv()
    parent = make_seq([1, 2, 3, 4, 5], n=3)
    prefill(kv, parent)
    children = [make_child(parent, i) for i in (1, 2)]
    for child in children:
        kv.fork(parent, child)
    shared = parent.block_table[1]
    assert kv.pool.ref_cnt[shared] == 3
    cows = []
    for seq, token in zip([parent, *children], (7, 8, 9), strict=True):
        seq.token_ids.append(token)
        cows.append(kv.append(seq, 1)[1])
        seq.num_computed_tokens += 1
    assert len(cows[0]) == len(cows[1]) == 1
    assert cows[0][0][1] == cows[1][0][1] == shared
    assert cows[2] == ()
    assert cows[0][0][2] != cows[1][0][2]
    assert children[1].block_table[1] == shared
    assert kv.pool.check(expected_refs(kv, parent, *children)) == []


def test_no_copy_on_write_when_the_shared_prompt_ends_on_a_block_boundary() -> None:
    kv = make_kv()
    parent = make_seq([1, 2, 3, 4, 5, 6, 7, 8], n=2)
    prefill(kv, parent)
    child = make_child(parent, 1)
    kv.fork(parent, child)
    parent.token_ids.append(9)
    appended, cows = kv.append(parent, 1)
    assert cows == ()
    assert len(appended) == 1
    assert parent.block_table[:2] == child.block_table


def test_swap_out_moves_blocks_to_the_cpu_pool() -> None:
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=8)
    seq = make_seq(PROMPT10)
    prefill(kv, seq)
    table = list(seq.block_table)
    assert kv.can_swap_out(seq)
    pairs = kv.swap_out(seq)
    assert [device for device, _ in pairs] == table
    cpu_blocks = [cpu for _, cpu in pairs]
    assert seq.cpu_block_table == cpu_blocks
    assert seq.block_table == []
    assert kv.cpu_pool.num_free == 5
    assert kv.pool.num_free == 8
    assert kv.cpu_pool.check(cpu_blocks) == []
    assert seq.num_computed_tokens == 10  # kept: the K/V live on in the CPU pool


def test_can_swap_out_needs_blocks_and_cpu_room() -> None:
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=2)
    seq = make_seq(PROMPT10)
    assert not kv.can_swap_out(seq)  # holds nothing
    prefill(kv, seq)
    assert not kv.can_swap_out(seq)  # 3 blocks, 2 CPU blocks
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=3)
    seq = make_seq(PROMPT10)
    prefill(kv, seq)
    assert kv.can_swap_out(seq)  # 3 blocks, exactly 3 CPU blocks
    short = make_seq([7, 8])
    prefill(kv, short)
    assert kv.can_swap_out(short)  # one block


def test_swap_in_reuses_still_cached_full_blocks() -> None:
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=8)
    seq = make_seq(PROMPT10)
    prefill(kv, seq)
    table = list(seq.block_table)
    cpu_blocks = [cpu for _, cpu in kv.swap_out(seq)]

    hits = kv.find_swap_hits(seq)
    assert hits == table[:2]  # the full blocks; the partial one was never cached
    seq.token_ids.append(77)
    assert kv.can_swap_in(seq, hits, 1, reserve=0)
    copies, release = kv.swap_in(seq, hits)
    assert len(copies) == 1
    assert copies[0][0] == cpu_blocks[2]
    assert seq.block_table == [*hits, copies[0][1]]
    assert seq.cpu_block_table == []
    assert release == cpu_blocks
    # The CPU blocks stay allocated until the caller releases them after the step.
    assert kv.cpu_pool.num_free == 5
    kv.cpu_pool.release(release)
    assert kv.cpu_pool.num_free == 8
    kv.append(seq, 1)
    assert kv.pool.check(expected_refs(kv, seq)) == []


def test_swap_in_copies_everything_once_the_cache_was_evicted() -> None:
    kv = make_kv(num_gpu_blocks=4, num_cpu_blocks=8)
    seq = make_seq(PROMPT10)
    prefill(kv, seq)
    cpu_blocks = [cpu for _, cpu in kv.swap_out(seq)]
    kv.pool.release(kv.pool.allocate(4))  # evicts the cached blocks
    hits = kv.find_swap_hits(seq)
    assert hits == []
    copies, _ = kv.swap_in(seq, hits)
    assert [cpu for cpu, _ in copies] == cpu_blocks
    assert len(seq.block_table) == 3


def test_can_swap_in_counts_the_blocks_it_needs() -> None:
    kv = make_kv(num_gpu_blocks=4, num_cpu_blocks=8)
    seq = make_seq(PROMPT12)
    prefill(kv, seq)
    kv.swap_out(seq)
    kv.pool.release(kv.pool.allocate(4))  # no hits left
    seq.token_ids.append(1)
    hits = kv.find_swap_hits(seq)
    # 12 computed + 1 new = 4 blocks, no hits.
    assert kv.can_swap_in(seq, hits, 1, reserve=0)
    assert not kv.can_swap_in(seq, hits, 1, reserve=1)


def test_prefix_caching_disabled_gives_no_hits() -> None:
    kv = make_kv(prefix=False)
    first = make_seq(PROMPT12)
    prefill(kv, first)
    assert kv.pool.cached == {}
    second = make_seq(PROMPT12)
    assert kv.find_prefix(second) == []
    assert kv.find_cached(second, 3) == []
    kv.swap_out(first)
    assert kv.find_swap_hits(first) == []


@pytest.mark.parametrize("length", [5, 8, 9, 12, 13])
def test_find_prefix_hit_size_formula(length: int) -> None:
    kv = make_kv(num_gpu_blocks=32)
    tokens = list(range(300, 300 + length))
    prefill(kv, make_seq(tokens))
    assert len(kv.find_prefix(make_seq(tokens))) == (length - 1) // BS


def test_a_private_duplicate_block_does_not_block_later_hits() -> None:
    # Two identical one-block prompts admitted together: find_prefix leaves the last
    # block to compute, so the second one holds a private copy of block 0. Its later
    # full blocks are cached too, keyed on that private copy. A third and fourth
    # sequence with the same tokens must eventually share the second block again.
    kv = make_kv(num_gpu_blocks=16)
    a = make_seq([1, 2, 3, 4])
    b = make_seq([1, 2, 3, 4])
    prefill(kv, a)
    prefill(kv, b)
    assert a.block_table != b.block_table  # b computed a private copy
    for token in (5, 6, 7, 8, 9):
        decode(kv, b, token)
    kv.free(b)

    c = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(kv, c)  # computes (and should cache) the second block itself
    d = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits = kv.find_prefix(d)
    assert hits[:1] == a.block_table
    assert len(hits) == 2, "the second block is cached but unreachable"
