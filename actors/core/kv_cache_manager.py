"""Paged KV cache bookkeeping: per-request block tables over a shared BlockPool.

The scheduler owns its KVCacheManager and calls it directly, once per step
(actors/core/kv_allocation.py), as vLLM's scheduler owns its KV cache manager: both live on
the engine loop, so a message between them would buy nothing.

Prefix caching, as vLLM's KVCacheManager: every full block of a request's tokens is hashed,
chained on the previous block's hash and salted by `cache_salt` (actors/core/prefix_hash.py),
and published once its KV is computed, so a later request with the same tokens shares it,
whether they were prompt or output (a chat's next turn sends the previous answer back).

* Hashes: the tokens known at admission (the prompt, or prompt + outputs when a request
  resumes after preemption) are hashed then; a block completed later by decoding is hashed
  when its last token arrives (`cache_blocks`, from the scheduler's update).
* Publishing: a block joins the cache in the step whose scheduled tokens complete its KV,
  not when it is allocated (a chunked prefill may leave an allocated block partly written),
  and only once every token in it is known. So a request that hits it reads KV written in
  an earlier step, or by a row of the same step (each layer writes the whole batch's KV
  before attending). Two events can complete a block, whichever comes second:
  - its last position is scheduled (`allocate_step`) while its tokens are known: prefill,
    or a decode whose token arrived before the step was built;
  - its last token arrives (`cache_blocks`) while its position is scheduled already: in
    the overlapped loop the step that computes a sampled token's KV is built before the
    token is known, so the block is published one update later.
  Speculative draft slots never enter a hash: only accepted tokens reach a request's
  outputs, and a slot's KV counts only once its own token is known (the row's computed
  count is an upper bound only past its last known token: actors/core/spec_scheduling.py).
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
from actors.core.kv_offload import KVOffload, Lookup
from actors.core.prefix_hash import BlockHash, chain_block_hashes, hash_full_blocks
from actors.protocol.messages import KVTransfer


@dataclass(slots=True, eq=False)
class _RequestBlocks:
    block_ids: list[int]
    block_hashes: list[BlockHash]
    """Hashes of the full blocks of the request's known tokens (empty without prefix
    caching); decoding appends to them."""
    num_offered_blocks: int
    """Blocks [0, num_offered_blocks) were cache hits or have been offered to the cache."""
    cache_salt: str | None = None


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        offload: KVOffload | None = None,
    ) -> None:
        """`offload`: the host-memory (and disk) tiers behind the pool, when on."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.offload = offload if enable_prefix_caching else None
        if self.offload is not None:
            self.pool.evicted = []
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
            kv_tiers=() if self.offload is None else self.offload.stats(),
        )

    def take_transfer(self) -> KVTransfer | None:
        """The offload copies decided since the last call, for the step being built."""
        return None if self.offload is None else self.offload.take_transfer()

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

    def cache_blocks(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        num_computed_tokens: int,
    ) -> None:
        """New output tokens of a running request have arrived: hash the blocks they fill,
        and publish those whose KV is computed or scheduled in a step already built
        (positions below `num_computed_tokens`). Called when the known tokens cross a block
        boundary; the rest waits for the step that schedules the blocks' last positions.
        Unknown ids are ignored (the request's blocks were freed)."""
        state = self._requests.get(request_id)
        if state is None or not self.enable_prefix_caching:
            return
        num_full_blocks = (len(prompt_token_ids) + len(output_token_ids)) // self.block_size
        num_hashed_blocks = len(state.block_hashes)
        if num_full_blocks > num_hashed_blocks:
            tokens = _token_slice(
                prompt_token_ids,
                output_token_ids,
                num_hashed_blocks * self.block_size,
                num_full_blocks * self.block_size,
            )
            parent = state.block_hashes[-1] if state.block_hashes else None
            state.block_hashes += chain_block_hashes(
                parent, tokens, self.block_size, state.cache_salt
            )
        if state.num_offered_blocks < len(state.block_hashes):
            self._publish_full_blocks(state, num_computed_tokens)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds (as vLLM's reset_prefix_cache); returns
        how many. Blocks in use stay cached. Hit and query counts are cumulative and stay."""
        return self.pool.drop_evictable()

    def reset_offload_tiers(self) -> int:
        """Drop every block of the host-memory and disk tiers; returns how many."""
        return 0 if self.offload is None else self.offload.reset()

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
        if self.offload is not None:
            self.offload.check_invariants()
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
                new_blocks = tuple(self._allocate_blocks(num_missing))
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
        lookup = self._find_offloaded(hashes[len(hit_block_ids) : max_hit_blocks])
        num_loaded = len(lookup.host_slots)
        num_cached = (len(hit_block_ids) + num_loaded) * self.block_size
        num_new = min(num_tokens - num_cached, entry.max_num_new_tokens, token_budget)
        num_needed = -(-(num_cached + num_new) // self.block_size) - len(hit_block_ids)
        num_revived = sum(1 for block_id in hit_block_ids if self.pool.is_evictable(block_id))
        if num_needed > self.pool.num_allocatable_blocks - num_revived:
            return None
        self.pool.touch(hit_block_ids)
        new_block_ids = self._allocate_blocks(num_needed)
        self._load_offloaded(lookup, hashes[len(hit_block_ids) :], new_block_ids[:num_loaded])
        state = _RequestBlocks(
            hit_block_ids + new_block_ids,
            hashes,
            len(hit_block_ids) + num_loaded,
            entry.cache_salt,
        )
        self._requests[entry.request_id] = state
        self._publish_full_blocks(state, num_cached + num_new)
        if self.enable_prefix_caching:
            self._num_query_tokens += num_tokens
            self._num_hit_tokens += len(hit_block_ids) * self.block_size  # the device pool's
        return WaitingGrant(entry.request_id, tuple(state.block_ids), num_cached, num_new)

    def _allocate_blocks(self, num_blocks: int) -> list[int]:
        block_ids = self.pool.allocate(num_blocks)
        evicted = self.pool.evicted
        if evicted and self.offload is not None:
            self.offload.save_evicted(evicted)
            evicted.clear()
        return block_ids

    def _find_offloaded(self, hashes: Sequence[BlockHash]) -> Lookup:
        """The blocks after the device pool's hits that the offload tiers hold, in order up
        to the first they miss."""
        lookup = Lookup()
        if self.offload is not None:
            for block_hash in hashes:
                if not self.offload.find(block_hash, lookup):
                    break
        return lookup

    def _load_offloaded(
        self, lookup: Lookup, hashes: Sequence[BlockHash], block_ids: Sequence[int]
    ) -> None:
        """Copy the tiers' hits into the request's new blocks and publish them now: the
        worker runs the loads before the step's forward, so any reader sees the KV."""
        if self.offload is None:
            return
        for slot, block_hash, block_id in zip(lookup.host_slots, hashes, block_ids, strict=False):
            self.offload.load(slot, block_id)
            self.pool.register(block_id, block_hash)
        self.offload.commit(lookup)

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


def _token_slice(
    prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], start: int, stop: int
) -> Sequence[int]:
    """Tokens [start, stop) of prompt + outputs, without copying the whole sequence (this
    runs while a long request decodes)."""
    num_prompt_tokens = len(prompt_token_ids)
    if stop <= num_prompt_tokens:
        return prompt_token_ids[start:stop]
    if start >= num_prompt_tokens:
        return output_token_ids[start - num_prompt_tokens : stop - num_prompt_tokens]
    return (*prompt_token_ids[start:], *output_token_ids[: stop - num_prompt_tokens])
