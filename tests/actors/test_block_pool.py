from __future__ import annotations

import subprocess
import sys

import pytest

from actors.core.block_pool import BlockPool
from actors.core.prefix_hash import hash_block, hash_full_blocks

# ---- prefix hashes ------------------------------------------------------------------


def test_full_blocks_are_chained_from_the_first_block() -> None:
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, block_size=4)
    assert len(hashes) == 2  # tokens 8 and 9 do not fill a block
    first = hash_block(None, tokens[0:4])
    assert hashes == [first, hash_block(first, tokens[4:8])]


def test_equal_blocks_after_different_prefixes_hash_differently() -> None:
    a = hash_full_blocks([1, 2, 3, 4, 9, 9, 9, 9], block_size=4)
    b = hash_full_blocks([5, 6, 7, 8, 9, 9, 9, 9], block_size=4)
    assert a[1] != b[1]
    assert hash_full_blocks([1, 2, 3, 4, 7, 7, 7, 7], 4)[0] == a[0]


def test_salt_isolates_and_none_differs_from_empty() -> None:
    tokens = [3, 1, 4, 1]
    digests = {hash_block(None, tokens, salt) for salt in (None, "", "a", "b")}
    assert len(digests) == 4
    assert hash_block(None, tokens, "a") == hash_block(None, tokens, "a")


def test_known_prefix_hashes_are_extended_not_recomputed() -> None:
    tokens = list(range(40))
    prefix = hash_full_blocks(tokens[:17], block_size=8, cache_salt="s")
    extended = hash_full_blocks(tokens, 8, "s", prefix_hashes=prefix)
    assert extended == hash_full_blocks(tokens, 8, "s")


def test_hashes_are_stable_across_processes() -> None:
    code = (
        "from actors.core.prefix_hash import hash_full_blocks;"
        "print(hash_full_blocks(list(range(64)), 16, 'salt')[-1].hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == hash_full_blocks(list(range(64)), 16, "salt")[-1].hex()


def test_bad_tokens_and_block_size_raise_value_error() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        hash_block(None, [2**70])
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks([1, 2], block_size=0)


# ---- block pool ---------------------------------------------------------------------


def test_allocate_and_free_track_refcounts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and all(pool.ref_count(b) == 1 for b in blocks)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    pool.free(blocks)
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    pool.check_invariants()


def test_allocating_more_than_the_pool_holds_raises() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="only 1 of 2"):
        pool.allocate(2)


def test_freed_hashed_block_stays_cached_until_evicted() -> None:
    pool = BlockPool(2)
    cached, plain = pool.allocate(2)
    assert pool.register(cached, b"h" * 16)
    pool.free([cached, plain])
    assert pool.is_evictable(cached) and pool.lookup(b"h" * 16) == cached
    # The plain free block goes first; the cached one is evicted only when nothing else is left.
    assert pool.allocate(1) == [plain]
    assert pool.lookup(b"h" * 16) == cached
    assert pool.allocate(1) == [cached]
    assert pool.lookup(b"h" * 16) is None and pool.block_hash(cached) is None
    pool.check_invariants()


def test_eviction_takes_the_least_recently_freed_block_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for index, block in enumerate(blocks):
        pool.register(block, bytes([index]) * 16)
    pool.free([blocks[1]])
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    assert pool.allocate(2) == [blocks[1], blocks[2]]
    assert pool.lookup(bytes([0]) * 16) == blocks[0]


def test_touch_revives_an_evictable_block_and_shares_an_in_use_one() -> None:
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    pool.register(block, b"x" * 16)
    pool.touch([block])  # a second request hits the in-use block
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and not pool.is_evictable(block)
    pool.free([block])
    assert pool.is_evictable(block)
    pool.touch([block])
    assert pool.ref_count(block) == 1 and not pool.is_evictable(block)
    assert pool.num_allocatable_blocks == 1
    pool.check_invariants()


def test_register_keeps_the_first_copy_of_a_hash() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    assert pool.register(first, b"d" * 16)
    assert not pool.register(second, b"d" * 16)
    pool.free([second])
    assert pool.num_free_blocks == 1 and pool.num_cached_blocks == 1


def test_misuse_raises_clear_errors() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])
    with pytest.raises(ValueError, match="holds no cached KV"):
        pool.touch([0])
    with pytest.raises(ValueError, match="not in use"):
        pool.register(1, b"z" * 16)


def test_invariant_check_reports_a_corrupted_refcount() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._ref_counts[2] = 1  # a free block that claims a holder
    with pytest.raises(AssertionError, match="free"):
        pool.check_invariants()


def test_holders_check_names_each_broken_table() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.check_holders({"r1": [a, b]})
    with pytest.raises(AssertionError, match=f"block {a} has refcount 1 but 0 block tables"):
        pool.check_holders({"r1": [b]})
    with pytest.raises(AssertionError, match="holds a block twice"):
        pool.check_holders({"r1": [a, b, a]})
    pool.touch([a])  # a second holder of an uncached block
    with pytest.raises(AssertionError, match=f"block {a} is in 2 tables but is not a shared"):
        pool.check_holders({"r1": [a, b], "r2": [a]})
    pool.register(a, hash_block(None, [1, 2, 3, 4]))
    pool.check_holders({"r1": [a, b], "r2": [a]})
