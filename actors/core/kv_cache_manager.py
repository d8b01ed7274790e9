"""Paged KV cache bookkeeping: per-request block tables over a shared BlockPool.

The scheduler owns its KVCacheManager and calls it directly, once per step
(actors/core/kv_allocation.py), as vLLM's scheduler owns its KV cache manager: both live on
the engine loop, so a message between them would buy nothing.

Prefix caching: the full blocks of the tokens known when a request is admitted (its
prompt, or prompt + outputs when it resumes after preemption) are hashed once, at
admission. A block is published under its hash in the step whose scheduled tokens complete
it, not when it is allocated (a chunked prefill may leave an allocated block partly
written), so a request that hits it reads KV written in an earlier step or by a request
earlier in the same step's batch. Blocks completed later by decoding are not published:
that keeps the cache to admission-time hashes, and a resumed request hashes its outputs
then.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from actors.core.block_pool import BlockPool
from actors.core.kv_allocation import (
    AllocateStep,
    KVUsage,
    RunningAllocs,
    StepAllocation,
    WaitingAlloc,
    WaitingGrant,
)
from actors.core.prefix_hash import BlockHash, hash_full_blocks


@dataclass(slots=True, eq=False)
class _RequestBlocks:
    block_ids: list[int]
    block_hashes: list[BlockHash]
    """Hashes of the full blocks of the tokens known at admission."""
    num_offered_blocks: int
    """Blocks [0, num_offered_blocks) were cache hits or have been offered to the cache."""


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        # Hashes of waiting requests that were offered but not admitted, so a request stuck
        # at the head of the queue is not re-hashed every step.
        self._waiting_hashes: dict[str, list[BlockHash]] = {}
        self._num_query_tokens = 0
        self._num_hit_tokens = 0

    # ---- queries --------------------------------------------------------------------

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        state = self._requests.get(request_id)
        return () if state is None else tuple(state.block_ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def stats(self) -> KVUsage:
        pool = self.pool
        return KVUsage(
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.num_allocatable_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            usage_perc=pool.num_used_blocks / pool.num_blocks,
            prefix_cache_queries_tokens=self._num_query_tokens,
            prefix_cache_hits_tokens=self._num_hit_tokens,
        )

    # ---- commands -------------------------------------------------------------------

    def allocate_step(self, msg: AllocateStep) -> StepAllocation:
        self._validate(msg)
        self.free(msg.free_request_ids)
        new_block_ids = self._allocate_running(msg.running)
        grants: list[WaitingGrant] = []
        if len(new_block_ids) == len(msg.running):
            grants = self._admit_waiting(msg.waiting, msg.token_budget)
        return StepAllocation(
            num_running_ok=len(new_block_ids),
            new_block_ids=tuple(new_block_ids),
            waiting=tuple(grants),
            usage=self.stats(),
        )

    def free(self, request_ids: Iterable[str]) -> None:
        """Release the requests' blocks; unknown ids are ignored (nothing was allocated)."""
        for request_id in request_ids:
            self._waiting_hashes.pop(request_id, None)
            state = self._requests.pop(request_id, None)
            if state is not None:
                # Tail first: the LRU then evicts a prefix's last blocks before its first
                # ones, which more requests share.
                self.pool.free(reversed(state.block_ids))

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken invariant."""
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            if len(set(state.block_ids)) != len(state.block_ids):
                raise AssertionError(f"request {request_id} holds a block twice: {state.block_ids}")
            holders.update(state.block_ids)
        for block_id in range(self.pool.num_blocks):
            num_holders = holders.get(block_id, 0)
            if self.pool.ref_count(block_id) != num_holders:
                raise AssertionError(
                    f"block {block_id} has refcount "
                    f"{self.pool.ref_count(block_id)} but {num_holders} block "
                    f"tables hold it"
                )
            if num_holders > 1 and self.pool.block_hash(block_id) is None:
                raise AssertionError(
                    f"block {block_id} is in {num_holders} tables but is not a shared cached block"
                )

    # ---- internals ------------------------------------------------------------------

    def _allocate_running(self, running: RunningAllocs) -> list[tuple[int, ...]]:
        """The blocks appended to each entry's table, in order, up to the first entry the
        pool cannot serve. Most decode rows need no new block (one in block_size does) and
        have offered every hashed block already: for them this is a lookup and a compare."""
        new_block_ids: list[tuple[int, ...]] = []
        for request_id, num_tokens in zip(running.request_ids, running.num_tokens):
            state = self._requests[request_id]
            num_missing = -(-num_tokens // self.block_size) - len(state.block_ids)
            new_blocks: tuple[int, ...] = ()
            if num_missing > 0:
                if num_missing > self.pool.num_allocatable_blocks:
                    break
                new_blocks = tuple(self.pool.allocate(num_missing))
                state.block_ids.extend(new_blocks)
            if state.num_offered_blocks < len(state.block_hashes):
                self._publish_full_blocks(state, num_tokens)
            new_block_ids.append(new_blocks)
        return new_block_ids

    def _admit_waiting(
        self, entries: Sequence[WaitingAlloc], token_budget: int
    ) -> list[WaitingGrant]:
        old_hashes, self._waiting_hashes = self._waiting_hashes, {}
        grants: list[WaitingGrant] = []
        for position, entry in enumerate(entries):
            if token_budget <= 0:
                self._keep_waiting_hashes(entries[position:], old_hashes)
                break
            hashes = self._hash_prompt(entry, old_hashes.get(entry.request_id, ()))
            grant = self._admit(entry, hashes, token_budget)
            if grant is None:
                self._waiting_hashes[entry.request_id] = hashes
                self._keep_waiting_hashes(entries[position + 1 :], old_hashes)
                break
            token_budget -= grant.num_new_tokens
            grants.append(grant)
        return grants

    def _keep_waiting_hashes(
        self, entries: Sequence[WaitingAlloc], old_hashes: dict[str, list[BlockHash]]
    ) -> None:
        for entry in entries:
            if entry.request_id in old_hashes:
                self._waiting_hashes[entry.request_id] = old_hashes[entry.request_id]

    def _hash_prompt(self, entry: WaitingAlloc, known: Sequence[BlockHash]) -> list[BlockHash]:
        if not self.enable_prefix_caching:
            return []
        return hash_full_blocks(entry.token_ids, self.block_size, entry.cache_salt, known)

    def _admit(
        self, entry: WaitingAlloc, hashes: list[BlockHash], token_budget: int
    ) -> WaitingGrant | None:
        num_tokens = len(entry.token_ids)
        # At least one token must be computed so the step produces logits to sample from.
        max_hit_blocks = (num_tokens - 1) // self.block_size if entry.reuse_cached_prefix else 0
        hit_block_ids: list[int] = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        num_cached = len(hit_block_ids) * self.block_size
        num_new = min(num_tokens - num_cached, entry.max_num_new_tokens, token_budget)
        num_needed = -(-(num_cached + num_new) // self.block_size) - len(hit_block_ids)
        num_revived = sum(1 for block_id in hit_block_ids if self.pool.is_evictable(block_id))
        if num_needed > self.pool.num_allocatable_blocks - num_revived:
            return None
        self.pool.touch(hit_block_ids)
        state = _RequestBlocks(
            hit_block_ids + self.pool.allocate(num_needed), hashes, len(hit_block_ids)
        )
        self._requests[entry.request_id] = state
        self._publish_full_blocks(state, num_cached + num_new)
        if self.enable_prefix_caching:
            self._num_query_tokens += num_tokens
            self._num_hit_tokens += num_cached
        return WaitingGrant(entry.request_id, tuple(state.block_ids), num_cached, num_new)

    def _publish_full_blocks(self, state: _RequestBlocks, num_tokens: int) -> None:
        end = min(len(state.block_hashes), num_tokens // self.block_size)
        for index in range(state.num_offered_blocks, end):
            self.pool.register(state.block_ids[index], state.block_hashes[index])
        state.num_offered_blocks = max(state.num_offered_blocks, end)

    def _validate(self, msg: AllocateStep) -> None:
        if msg.token_budget < 0:
            raise ValueError(f"token_budget must be >= 0, got {msg.token_budget}")
        freed = set(msg.free_request_ids)
        running_ids = self._validate_running(msg.running, freed)
        waiting_ids: set[str] = set()
        for entry in msg.waiting:
            request_id = entry.request_id
            held = request_id in self._requests and request_id not in freed
            if held or request_id in running_ids or request_id in waiting_ids:
                raise ValueError(
                    f"waiting request {request_id!r} already holds blocks or is listed twice"
                )
            if not entry.token_ids:
                raise ValueError(f"waiting request {request_id!r} has no tokens")
            if not 0 < entry.num_prompt_tokens <= len(entry.token_ids):
                raise ValueError(
                    f"waiting request {request_id!r}: num_prompt_tokens "
                    f"{entry.num_prompt_tokens} not in [1, {len(entry.token_ids)}]"
                )
            if entry.max_num_new_tokens < 1:
                raise ValueError(f"waiting request {request_id!r}: max_num_new_tokens must be >= 1")
            waiting_ids.add(request_id)

    def _validate_running(self, running: RunningAllocs, freed: set[str]) -> set[str]:
        """The running entries' ids; checked as whole columns, since a batch holds many."""
        request_ids = running.request_ids
        running_ids = set(request_ids)
        if len(running.num_tokens) != len(request_ids):
            raise ValueError(
                f"{len(request_ids)} running requests but {len(running.num_tokens)} token counts"
            )
        if not running_ids <= self._requests.keys() or not running_ids.isdisjoint(freed):
            request_id = next(r for r in request_ids if r not in self._requests or r in freed)
            raise ValueError(f"running request {request_id!r} holds no blocks")
        if len(running_ids) != len(request_ids):
            request_id = next(r for i, r in enumerate(request_ids) if r in request_ids[:i])
            raise ValueError(f"running request {request_id!r} is listed twice")
        if request_ids and min(running.num_tokens) < 0:
            request_id = request_ids[running.num_tokens.index(min(running.num_tokens))]
            raise ValueError(f"running request {request_id!r}: num_tokens must be >= 0")
        return running_ids
