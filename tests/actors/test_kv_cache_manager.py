from __future__ import annotations

import pytest

import actors.core.prefix_hash as prefix_hash
from actors.core.kv_allocation import (
    AllocateStep,
    RunningAllocs,
    StepAllocation,
    WaitingAlloc,
)
from actors.core.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 16


def waiting(
    request_id: str, tokens: list[int] | range, salt: str | None = None, max_new: int = 10_000
) -> WaitingAlloc:
    token_ids = tuple(tokens)
    return WaitingAlloc(request_id, token_ids, len(token_ids), max_new, salt)


def step(
    manager: KVCacheManager,
    *,
    free: tuple[str, ...] = (),
    running: RunningAllocs = RunningAllocs(),
    admit: tuple[WaitingAlloc, ...] = (),
    budget: int = 10_000,
) -> StepAllocation:
    allocation = manager.allocate_step(AllocateStep(free, running, admit, budget))
    manager.check_invariants()
    return allocation


def admit_one(manager: KVCacheManager, entry: WaitingAlloc, budget: int = 10_000):
    (grant,) = step(manager, admit=(entry,), budget=budget).waiting
    return grant


def test_repeated_prompt_hits_the_cache_after_the_first_request_finishes() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = range(40)  # two full blocks and a partial one
    first = admit_one(manager, waiting("a", prompt))
    assert (first.num_cached_tokens, first.num_new_tokens, len(first.block_ids)) == (0, 40, 3)
    manager.free(["a"])
    second = admit_one(manager, waiting("b", prompt))
    assert second.num_cached_tokens == 32 and second.num_new_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    usage = manager.stats()
    assert (usage.prefix_cache_queries_tokens, usage.prefix_cache_hits_tokens) == (80, 32)


def test_hit_is_capped_so_that_one_token_is_computed() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit_one(manager, waiting("a", range(32)))
    grant = admit_one(manager, waiting("b", range(32)))
    # Both blocks are cached, but the last token must run to produce logits.
    assert grant.num_cached_tokens == 16 and grant.num_new_tokens == 16


def test_shared_blocks_are_refcounted_while_both_requests_hold_them() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    allocation = step(manager, admit=(waiting("a", range(48)), waiting("b", range(48))))
    a, b = allocation.waiting
    assert b.num_cached_tokens == 32 and b.block_ids[:2] == a.block_ids[:2]
    assert [manager.pool.ref_count(block) for block in a.block_ids] == [2, 2, 1]
    assert manager.stats().num_used_blocks == 4
    manager.free(["a"])
    manager.check_invariants()
    assert [manager.pool.ref_count(block) for block in b.block_ids] == [1, 1, 1]
    manager.free(["b"])
    manager.check_invariants()
    usage = manager.stats()
    assert usage.num_used_blocks == 0 and usage.num_free_blocks == 8
    assert usage.num_cached_blocks == 3  # a's three full blocks (b's copy of block 2 was not kept)


def test_blocks_are_published_only_once_computed_tokens_cover_them() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = range(64)
    admit_one(manager, waiting("a", prompt), budget=20)  # block 0 full, block 1 partial
    assert admit_one(manager, waiting("b", prompt), budget=1).num_cached_tokens == 16
    step(manager, running=RunningAllocs(("a",), (64,)))
    assert admit_one(manager, waiting("c", prompt), budget=1).num_cached_tokens == 48


def test_a_chunk_that_fills_a_held_block_publishes_it() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = range(64)
    admit_one(manager, waiting("a", prompt), budget=20)  # block 0 full, block 1 partial
    allocation = step(manager, running=RunningAllocs(("a",), (32,)))
    assert allocation.new_block_ids == ((),)  # block 1 was held already
    assert admit_one(manager, waiting("b", prompt), budget=1).num_cached_tokens == 32


def test_salt_isolates_cached_prefixes() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    admit_one(manager, waiting("a", range(33), salt="tenant-1"))
    assert admit_one(manager, waiting("b", range(33), salt="tenant-2")).num_cached_tokens == 0
    assert admit_one(manager, waiting("c", range(33))).num_cached_tokens == 0
    assert admit_one(manager, waiting("d", range(33), salt="tenant-1")).num_cached_tokens == 32


def cached_blocks(manager: KVCacheManager, tokens: range) -> list[bool]:
    hashes = prefix_hash.hash_full_blocks(list(tokens), BLOCK_SIZE)
    return [manager.pool.lookup(block_hash) is not None for block_hash in hashes]


def test_eviction_removes_the_least_recently_freed_prefix_first() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    step(manager, admit=(waiting("a", range(0, 17)), waiting("b", range(100, 117))))
    manager.free(["a"])
    manager.free(["b"])
    # The two partial blocks are free; a third block must come from the evictable cache.
    admit_one(manager, waiting("c", range(200, 248)))
    assert cached_blocks(manager, range(0, 16)) == [False]
    assert cached_blocks(manager, range(100, 116)) == [True]
    manager.free(["c"])
    assert admit_one(manager, waiting("b2", range(100, 117))).num_cached_tokens == 16


def test_a_freed_prefix_loses_its_tail_block_before_its_head() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    admit_one(manager, waiting("a", range(49)))  # 3 full blocks + 1 partial
    manager.free(["a"])
    admit_one(manager, waiting("x", range(500, 516)))  # takes the free partial block
    admit_one(manager, waiting("y", range(600, 616)))  # evicts one cached block
    assert cached_blocks(manager, range(48)) == [True, True, False]


def test_running_allocation_stops_at_the_first_failure_and_keeps_earlier_grants() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    step(manager, admit=(waiting("a", range(16)), waiting("b", range(100, 116))))
    allocation = step(
        manager, running=RunningAllocs(("a", "b"), (48, 64)), admit=(waiting("c", range(200, 201)),)
    )
    assert allocation.num_running_ok == 1
    assert len(allocation.new_block_ids) == 1 and len(allocation.new_block_ids[0]) == 2
    assert allocation.waiting == ()  # no admission while a running request lacks blocks
    assert len(manager.block_ids("a")) == 3 and len(manager.block_ids("b")) == 1
    assert not manager.has_request("c")


def test_waiting_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    allocation = step(
        manager,
        admit=(
            waiting("small", range(10)),
            waiting("huge", range(100)),
            waiting("tiny", range(300, 302)),
        ),
        budget=1000,
    )
    assert [grant.request_id for grant in allocation.waiting] == ["small"]
    assert not manager.has_request("tiny")


def test_token_budget_chunks_and_bounds_admission() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    allocation = step(
        manager,
        admit=(
            waiting("a", range(30)),
            waiting("b", range(100, 150)),
            waiting("c", range(200, 210)),
        ),
        budget=40,
    )
    assert [(g.request_id, g.num_new_tokens) for g in allocation.waiting] == [("a", 30), ("b", 10)]
    assert len(manager.block_ids("b")) == 1
    capped = step(manager, admit=(waiting("c", range(200, 260), max_new=5),)).waiting[0]
    assert capped.num_new_tokens == 5


def test_running_alloc_is_idempotent() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit_one(manager, waiting("a", range(5)))
    first = step(manager, running=RunningAllocs(("a",), (17,)))
    again = step(manager, running=RunningAllocs(("a",), (17,)))
    assert len(first.new_block_ids[0]) == 1 and again.new_block_ids == ((),)
    assert len(manager.block_ids("a")) == 2


def test_disabled_prefix_caching_never_hits_or_registers() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    admit_one(manager, waiting("a", range(40)))
    manager.free(["a"])
    assert admit_one(manager, waiting("b", range(40))).num_cached_tokens == 0
    usage = manager.stats()
    assert usage.num_cached_blocks == 0 and usage.prefix_cache_queries_tokens == 0


def test_a_blocked_waiting_request_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = prefix_hash._hash_packed
    monkeypatch.setattr(prefix_hash, "_hash_packed", lambda *a: calls.append(1) or real(*a))
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    blocked = waiting("big", range(64))  # needs 4 blocks, the pool has 2
    for _ in range(3):
        assert step(manager, admit=(blocked,)).waiting == ()
    assert len(calls) == 4


def test_bad_steps_are_rejected_before_anything_changes() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    admit_one(manager, waiting("a", range(5)))
    with pytest.raises(ValueError, match="'ghost' holds no blocks"):
        manager.allocate_step(AllocateStep(("a",), RunningAllocs(("ghost",), (4,)), (), 10))
    assert manager.has_request("a")
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_step(AllocateStep((), RunningAllocs(), (waiting("a", range(3)),), 10))
    with pytest.raises(ValueError, match="no tokens"):
        manager.allocate_step(AllocateStep((), RunningAllocs(), (waiting("e", []),), 10))
    with pytest.raises(ValueError, match="token_budget"):
        manager.allocate_step(AllocateStep((), RunningAllocs(), (), -1))
    with pytest.raises(ValueError, match="'a' is listed twice"):
        manager.allocate_step(AllocateStep((), RunningAllocs(("a", "a"), (4, 4)), (), 10))
    with pytest.raises(ValueError, match="'a': num_tokens must be >= 0"):
        manager.allocate_step(AllocateStep((), RunningAllocs(("a",), (-1,)), (), 10))
    with pytest.raises(ValueError, match="1 running requests but 2 token counts"):
        manager.allocate_step(AllocateStep((), RunningAllocs(("a",), (4, 4)), (), 10))
    manager.check_invariants()


def test_invariant_check_reports_a_refcount_that_no_table_explains() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    admit_one(manager, waiting("a", range(5)))
    manager.pool.touch(manager.block_ids("a"))  # a reference without a holder
    with pytest.raises(AssertionError, match="refcount 2 but 1 block tables"):
        manager.check_invariants()
