"""DeviceBlockPool (refcounts, LRU free queue, prefix cache) and CpuBlockPool."""

from __future__ import annotations

import pytest

from scheduler_svc.core.block_pool import CpuBlockPool, DeviceBlockPool, chain_hash

KEY_A = (0, (1, 2, 3, 4))
KEY_B = (0, (5, 6, 7, 8))
HASH_A = chain_hash(*KEY_A)
HASH_B = chain_hash(*KEY_B)


def refs(pool: DeviceBlockPool) -> list[int]:
    return list(pool.ref_cnt)


# --------------------------------------------------------------------------- device pool


def test_fresh_pool_is_all_free_in_id_order() -> None:
    pool = DeviceBlockPool(4)
    assert pool.num_free == 4
    assert list(pool.free_queue) == [0, 1, 2, 3]
    assert pool.num_cached_free == 0
    assert pool.check([0, 0, 0, 0]) == []


def test_allocate_pops_the_front_of_the_free_queue() -> None:
    pool = DeviceBlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert refs(pool) == [1, 1, 0, 0]
    assert list(pool.free_queue) == [2, 3]
    assert pool.num_free == 2


def test_release_appends_to_the_tail_and_allocation_follows_lru_order() -> None:
    pool = DeviceBlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([2, 0])
    assert list(pool.free_queue) == [3, 2, 0]
    pool.release([1])
    assert list(pool.free_queue) == [3, 2, 0, 1]
    # Least recently freed first.
    assert pool.allocate(4) == [3, 2, 0, 1]
    assert pool.num_free == 0


def test_release_of_a_shared_block_keeps_it_until_the_last_reference() -> None:
    pool = DeviceBlockPool(2)
    (block,) = pool.allocate(1)
    pool.share([block])
    assert pool.ref_cnt[block] == 2
    pool.release([block])
    assert pool.ref_cnt[block] == 1
    assert block not in pool.free_queue
    pool.release([block])
    assert pool.ref_cnt[block] == 0
    assert list(pool.free_queue)[-1] == block


def test_allocate_more_than_free_raises_and_takes_nothing() -> None:
    pool = DeviceBlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="allocate"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert refs(pool) == [1, 1, 0]


def test_share_of_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = DeviceBlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache(block, HASH_A, KEY_A)
    pool.release([block])
    assert block in pool.free_queue
    assert pool.num_cached_free == 1

    pool.share([block])
    assert block not in pool.free_queue
    assert pool.ref_cnt[block] == 1
    assert pool.num_free == 2
    assert pool.num_cached_free == 0
    # It cannot be handed out (and evicted) while shared.
    others = pool.allocate(2)
    assert block not in others
    assert pool.lookup(HASH_A, KEY_A) == block
    assert pool.check([1, 1, 1]) == []


def test_share_of_a_used_block_only_adds_a_reference() -> None:
    pool = DeviceBlockPool(2)
    (block,) = pool.allocate(1)
    pool.share([block, block])
    assert pool.ref_cnt[block] == 3
    assert list(pool.free_queue) == [1]


def test_cache_and_lookup_verify_the_key() -> None:
    pool = DeviceBlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, HASH_A, KEY_A)
    assert pool.lookup(HASH_A, KEY_A) == block
    # Same hash, different content (a collision): never a hit.
    assert pool.lookup(HASH_A, KEY_B) is None
    assert pool.lookup(HASH_A, (1, KEY_A[1])) is None
    # Unknown hash.
    assert pool.lookup(HASH_B, KEY_B) is None
    assert pool.block_hash[block] == HASH_A
    assert pool.block_key[block] == KEY_A


def test_allocation_evicts_cached_content() -> None:
    pool = DeviceBlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, HASH_A, KEY_A)
    pool.release([block])
    assert pool.lookup(HASH_A, KEY_A) == block  # free but still cached

    got = pool.allocate(2)
    assert block in got
    assert pool.lookup(HASH_A, KEY_A) is None
    assert pool.block_hash[block] is None
    assert pool.block_key[block] is None
    assert HASH_A not in pool.cached


def test_eviction_takes_the_least_recently_freed_cached_block_first() -> None:
    pool = DeviceBlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, HASH_A, KEY_A)
    pool.cache(b, HASH_B, KEY_B)
    pool.release([a])
    pool.release([b])
    assert pool.num_cached_free == 2
    assert pool.allocate(1) == [a]
    assert pool.lookup(HASH_A, KEY_A) is None
    assert pool.lookup(HASH_B, KEY_B) == b
    assert pool.num_cached_free == 1
    assert c not in pool.free_queue


def test_a_second_block_with_the_same_hash_is_not_registered() -> None:
    pool = DeviceBlockPool(3)
    first, second = pool.allocate(2)
    pool.cache(first, HASH_A, KEY_A)
    pool.cache(second, HASH_A, KEY_A)
    assert pool.lookup(HASH_A, KEY_A) == first
    assert pool.block_hash[second] is None
    assert pool.cached == {HASH_A: first}
    # Evicting the private copy leaves the registered one alone.
    pool.release([second])
    pool.allocate(2)  # block 2, then `second`
    assert pool.lookup(HASH_A, KEY_A) == first
    pool.uncache(second)
    assert pool.lookup(HASH_A, KEY_A) == first


def test_a_cached_block_is_not_registered_twice() -> None:
    pool = DeviceBlockPool(1)
    (block,) = pool.allocate(1)
    pool.cache(block, HASH_A, KEY_A)
    pool.cache(block, HASH_B, KEY_B)
    assert pool.lookup(HASH_B, KEY_B) is None
    assert pool.lookup(HASH_A, KEY_A) == block


def test_uncache_forgets_the_block() -> None:
    pool = DeviceBlockPool(1)
    (block,) = pool.allocate(1)
    pool.cache(block, HASH_A, KEY_A)
    pool.uncache(block)
    assert pool.lookup(HASH_A, KEY_A) is None
    assert pool.cached == {}
    pool.uncache(block)  # no-op on an uncached block
    assert pool.cached == {}


def test_reset_prefix_cache_forgets_everything_but_keeps_refcounts() -> None:
    pool = DeviceBlockPool(3)
    a, b, _ = pool.allocate(3)
    pool.cache(a, HASH_A, KEY_A)
    pool.cache(b, HASH_B, KEY_B)
    pool.release([a])
    before_free = list(pool.free_queue)
    pool.reset_prefix_cache()
    assert pool.lookup(HASH_A, KEY_A) is None
    assert pool.lookup(HASH_B, KEY_B) is None
    assert pool.cached == {}
    assert pool.block_hash == [None, None, None]
    assert pool.num_cached_free == 0
    assert list(pool.free_queue) == before_free
    assert refs(pool) == [0, 1, 1]
    assert pool.check([0, 1, 1]) == []


def test_check_reports_a_refcount_mismatch() -> None:
    pool = DeviceBlockPool(3)
    pool.allocate(2)
    assert pool.check([1, 1, 0]) == []
    problems = pool.check([1, 2, 0])
    assert any("device block 1" in p and "refcount 1" in p and "held by 2" in p for p in problems)
    problems = pool.check([1, 0, 0])
    assert any("device block 1" in p for p in problems)
    with pytest.raises(ValueError):
        pool.check([1, 1])  # wrong length


def test_check_reports_a_used_block_in_the_free_queue_and_a_lost_free_block() -> None:
    pool = DeviceBlockPool(3)
    pool.allocate(1)
    pool.free_queue[0] = None  # in use yet free
    assert any("device block 0" in p for p in pool.check([1, 0, 0]))

    pool = DeviceBlockPool(3)
    del pool.free_queue[2]  # refcount 0 yet not free
    problems = pool.check([0, 0, 0])
    assert any("device block 2" in p for p in problems)
    assert any("!= 3" in p for p in problems)


def test_check_reports_a_stale_cache_entry() -> None:
    pool = DeviceBlockPool(2)
    a, _ = pool.allocate(2)
    pool.cache(a, HASH_A, KEY_A)
    pool.cached[HASH_B] = a  # maps to a block holding other content
    assert any("prefix cache" in p for p in pool.check([1, 1]))


def test_chain_hash_depends_on_parent_and_tokens() -> None:
    assert chain_hash(0, (1, 2)) == chain_hash(0, (1, 2))
    assert chain_hash(0, (1, 2)) != chain_hash(1, (1, 2))
    assert chain_hash(0, (1, 2)) != chain_hash(0, (2, 1))


# --------------------------------------------------------------------------- CPU pool


def test_cpu_pool_allocate_and_release() -> None:
    pool = CpuBlockPool(4)
    assert pool.num_free == 4
    blocks = pool.allocate(3)
    assert len(blocks) == 3
    assert len(set(blocks)) == 3
    assert all(0 <= b < 4 for b in blocks)
    assert pool.num_free == 1
    assert pool.check(blocks) == []
    pool.release(blocks[:2])
    assert pool.num_free == 3
    assert pool.check(blocks[2:]) == []
    again = pool.allocate(3)
    assert len(set(again) | {blocks[2]}) == 4
    assert pool.num_free == 0


def test_cpu_pool_over_allocation_raises() -> None:
    pool = CpuBlockPool(2)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="CPU"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_cpu_pool_double_release_raises() -> None:
    pool = CpuBlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release([block])
    assert pool.num_free == 2


def test_cpu_pool_release_of_a_never_allocated_block_raises() -> None:
    pool = CpuBlockPool(2)
    with pytest.raises(RuntimeError):
        pool.release([1])


def test_cpu_pool_check_reports_mismatches() -> None:
    pool = CpuBlockPool(4)
    blocks = pool.allocate(2)
    assert pool.check(blocks) == []
    assert pool.check(blocks[:1]) != []  # a used block nobody holds
    assert pool.check([*blocks, blocks[0]]) != []  # held twice
    free_block = next(b for b in range(4) if b not in blocks)
    assert pool.check([*blocks, free_block]) != []  # held but free


def test_empty_cpu_pool() -> None:
    pool = CpuBlockPool(0)
    assert pool.num_free == 0
    assert pool.allocate(0) == []
    assert pool.check([]) == []


def test_free_queue_matches_an_lru_ordered_dict_under_random_operations() -> None:
    # Taking free blocks out of the middle leaves stale entries (and, past num_blocks of
    # them, compacts): the order seen and allocated must stay exact LRU order.
    import random
    from collections import OrderedDict

    rng = random.Random(7)
    pool = DeviceBlockPool(8)
    model: OrderedDict[int, None] = OrderedDict.fromkeys(range(8))
    refcounts = [0] * 8
    for _ in range(3000):
        op = rng.random()
        if op < 0.02 and model:
            count = rng.randint(1, min(2, len(model)))
            expected = [model.popitem(last=False)[0] for _ in range(count)]
            assert pool.allocate(count) == expected
            for block in expected:
                refcounts[block] = 1
        elif op < 0.55:
            block = rng.randrange(8)
            if block in model:
                del model[block]
            pool.share([block])
            refcounts[block] += 1
        else:
            held = [b for b in range(8) if refcounts[b]]
            if held:
                block = rng.choice(held)
                pool.release([block])
                refcounts[block] -= 1
                if refcounts[block] == 0:
                    model[block] = None
        assert list(pool.free_queue) == list(model)
        assert pool.num_free == len(model)
        assert all((b in pool.free_queue) == (b in model) for b in range(8))
        assert pool.check(refcounts) == []


def test_free_queue_setitem_appends_and_delitem_takes_out() -> None:
    # The OrderedDict-style view: `queue[b] = None` puts a block at the back of the
    # eviction order, `del queue[b]` takes it out of the middle.
    pool = DeviceBlockPool(4)
    del pool.free_queue[1]
    assert list(pool.free_queue) == [0, 2, 3] and 1 not in pool.free_queue
    pool.free_queue[1] = None
    assert list(pool.free_queue) == [0, 2, 3, 1] and len(pool.free_queue) == 4
    pool.free_queue[1] = None  # already free: no second entry
    assert list(pool.free_queue) == [0, 2, 3, 1]
    assert pool.allocate(4) == [0, 2, 3, 1]
    with pytest.raises(KeyError, match=r"^0$"):
        del pool.free_queue[0]  # not free


def test_check_names_each_device_pool_inconsistency() -> None:
    pool = DeviceBlockPool(3)
    pool.allocate(1)
    pool.free_queue[0] = None  # in use yet free
    assert pool.check([1, 0, 0]) == [
        "device block 0: refcount 1 but free=True",
        "device blocks: 1 used + 3 free != 3",
    ]
    pool = DeviceBlockPool(3)
    del pool.free_queue[2]  # not in use yet not free
    assert pool.check([0, 0, 0]) == [
        "device block 2: refcount 0 but free=False",
        "device blocks: 0 used + 2 free != 3",
    ]
    pool = DeviceBlockPool(3)
    pool.allocate(2)
    pool.share([0])
    pool.num_shared = 0  # the count of shared blocks went stale
    assert pool.check([2, 1, 0]) == ["1 device blocks shared, counted 0"]
    pool = DeviceBlockPool(3)
    pool._is_free[2] = False  # flagged in use, yet in the free queue
    assert pool.check([0, 0, 0]) == [
        "device block 2: refcount 0 but free=False",
        "free queue holds 3 blocks, flagged 2",
    ]


def test_check_names_each_cpu_pool_inconsistency() -> None:
    pool = CpuBlockPool(12)
    held = pool.allocate(10)
    assert pool.check(held) == []
    assert pool.check(held + held[:1]) == ["a CPU block is held by two swapped sequences"]
    assert pool.check(held[:9]) == [
        "CPU blocks in use [0, 1, 2, 3, 4, 5, 6, 7]... differ from held [0, 1, 2, 3, 4, 5, 6, 7]..."
    ]
    pool._free.append(11)  # a block both free and in use
    assert pool.check(held) == ["CPU blocks: used + free != total"]
