"""Paged KV cache bookkeeping: per-request block tables over a shared BlockPool.

The scheduler owns it and calls it once per step (actors/core/kv_allocation.py), as vLLM's
does: both live on the engine loop, so a message between them would buy nothing.

Prefix caching, as vLLM's KVCacheManager: every full block of a request's tokens is hashed,
chained on the previous block's hash and salted by `cache_salt` (actors/core/prefix_hash.py),
and published once its KV is computed, so a later request with the same tokens shares it,
prompt or output (a chat's next turn sends the answer back; `cache_outputs` False: prompts).

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

Offload tiers (actors/core/kv_offload.py): a request whose prefix is loaded from host memory
is held until the loads are done, so they overlap other steps (actors/core/kv_holds.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from actors.core.block_pool import BlockPool
from actors.core.kv_allocation import (
    AllocateStep,
    KVUsage,
    RunningAllocs,
    StepAllocation,
    WaitingAlloc,
    WaitingGrant,
    validate_allocate_step,
)
from actors.core.kv_holds import Holds
from actors.core.kv_offload import KVOffload, Lookup
from actors.core.prefix_hash import BlockHash, chain_block_hashes, hash_full_blocks, token_slice
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


class _Wait(Enum):
    NO_ROOM = "no_room"
    """Too few blocks: the entry and the ones after it wait."""
    READING = "reading"
    """Its next blocks are being read from disk: the entries after it may go first."""


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        offload: KVOffload | None = None,
        cache_outputs: bool = True,
    ) -> None:
        """`offload`: the host-memory (and disk) tiers behind the pool, when on."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_outputs = cache_outputs
        self.pool = BlockPool(num_blocks)
        self.offload = offload if enable_prefix_caching else None
        if self.offload is not None:
            self.pool.evicted = []
        self._requests: dict[str, _RequestBlocks] = {}
        # Hashes of waiting requests that were offered but not admitted, so a request stuck
        # at the head of the queue is not re-hashed every step.
        self._waiting_hashes: dict[str, list[BlockHash]] = {}
        self._held = Holds()
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

    def loads_done(self, through_load_id: int) -> None:
        """The worker finished the offload loads numbered up to `through_load_id`."""
        if self.offload is not None:
            self.offload.loads_done(through_load_id)

    def take_transfer(self) -> KVTransfer | None:
        """The offload copies decided since the last call, for the step being built."""
        return None if self.offload is None else self.offload.take_transfer()

    # ---- commands -------------------------------------------------------------------

    def allocate_step(self, msg: AllocateStep) -> StepAllocation:
        validate_allocate_step(msg, self._requests, self._held)
        self.free(msg.free_request_ids)
        if self.offload is not None:
            self.offload.poll_reads()
        held = self._held.take()  # granted by this allocation or released
        new_block_ids = self._allocate_running(msg.running)
        grants: list[WaitingGrant] = []
        if len(new_block_ids) == len(msg.running):
            grants = self._admit_waiting(msg.waiting, msg.token_budget, held, not msg.running)
        self._release(held)
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
        if state is None or not (self.enable_prefix_caching and self.cache_outputs):
            return
        num_full_blocks = (len(prompt_token_ids) + len(output_token_ids)) // self.block_size
        num_hashed_blocks = len(state.block_hashes)
        if num_full_blocks > num_hashed_blocks:
            tokens = token_slice(
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
            self._held.discard(request_id)
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
        self._held.check_invariants(self._requests.keys())
        self.pool.check_holders({rid: state.block_ids for rid, state in self._requests.items()})

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
        self,
        entries: Sequence[WaitingAlloc],
        token_budget: int,
        held: Holds,
        idle: bool,
    ) -> list[WaitingGrant]:
        """Grants in entry order; `held`: the holds of the previous allocation, each granted
        here when its entry is reached (and popped); `idle`: no running row this step."""
        old_hashes, self._waiting_hashes = self._waiting_hashes, {}
        grants: list[WaitingGrant] = []
        new_holds: list[WaitingAlloc] = []
        for position, entry in enumerate(entries):
            if token_budget <= 0:
                self._keep_waiting_hashes(entries[position:], old_hashes)
                break
            request_id = entry.request_id
            admitted: WaitingGrant | _Wait | None
            if request_id in held:
                if self._loading(self._requests[request_id].block_ids):
                    held.move(request_id, self._held)  # its loads still run: held again
                    new_holds.append(entry)
                    continue
                admitted = self._grant_held(entry, held, token_budget)
            else:
                hashes = self._hash_prompt(entry, old_hashes.get(request_id, ()))
                admitted = self._admit(entry, hashes, token_budget)
                if isinstance(admitted, _Wait):
                    self._waiting_hashes[request_id] = hashes
            if admitted is None:
                new_holds.append(entry)
            elif admitted is _Wait.NO_ROOM:
                self._keep_waiting_hashes(entries[position + 1 :], old_hashes)
                break
            elif isinstance(admitted, WaitingGrant):
                token_budget -= admitted.num_new_tokens
                grants.append(admitted)
        if idle and new_holds and not grants:
            grants = self._run_holds_now(new_holds, token_budget)
        return grants

    def _run_holds_now(
        self, entries: Sequence[WaitingAlloc], token_budget: int
    ) -> list[WaitingGrant]:
        """Grant this allocation's holds at once (nothing else runs in the step to overlap
        their loads with); their forward waits for the loads."""
        grants: list[WaitingGrant] = []
        for entry in entries:
            if token_budget <= 0:
                break
            grant = self._grant_held(entry, self._held, token_budget)
            token_budget -= grant.num_new_tokens
            grants.append(grant)
        if self.offload is not None:
            self.offload.wait_for_loads()
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
    ) -> WaitingGrant | _Wait | None:
        """The entry's grant; None when it is held (actors/core/kv_holds.py)."""
        num_tokens = len(entry.token_ids)
        # At least one token must be computed so the step produces logits to sample from.
        max_hit_blocks = (num_tokens - 1) // self.block_size if entry.reuse_cached_prefix else 0
        hit_block_ids: list[int] = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        offloaded = hashes[len(hit_block_ids) : max_hit_blocks]
        lookup = self._held.lookup(self.offload, entry.request_id, offloaded)
        if lookup is None:
            return _Wait.READING
        num_loaded = len(lookup.host_slots)
        num_cached = (len(hit_block_ids) + num_loaded) * self.block_size
        num_new = min(num_tokens - num_cached, entry.max_num_new_tokens, token_budget)
        num_needed = -(-(num_cached + num_new) // self.block_size) - len(hit_block_ids)
        num_revived = sum(1 for block_id in hit_block_ids if self.pool.is_evictable(block_id))
        if num_needed > self.pool.num_allocatable_blocks - num_revived:
            return _Wait.NO_ROOM
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
        counted = (0, 0)
        if self.enable_prefix_caching:
            counted = (num_tokens, len(hit_block_ids) * self.block_size)  # the device pool's
        if num_loaded or self._loading(hit_block_ids):
            self._held.hold(entry.request_id, num_cached, counted)
            return None
        self._count_lookup(counted)
        return self._grant(entry.request_id, state, num_cached, num_new)

    def _count_lookup(self, counted: tuple[int, int]) -> None:
        """Count a granted admission's lookups (not a hold's, which may be released)."""
        self._num_query_tokens += counted[0]
        self._num_hit_tokens += counted[1]

    def _loading(self, block_ids: Sequence[int]) -> bool:
        return self.offload is not None and self.offload.any_loading(block_ids)

    def _grant_held(self, entry: WaitingAlloc, held: Holds, token_budget: int) -> WaitingGrant:
        """A held request's grant (popped from `held`), within the blocks it holds (at least
        one token)."""
        self._count_lookup(held.counted(entry.request_id))
        num_cached = held.pop(entry.request_id)
        state = self._requests[entry.request_id]
        num_free_slots = len(state.block_ids) * self.block_size - num_cached
        num_left = len(entry.token_ids) - num_cached
        num_new = min(num_left, entry.max_num_new_tokens, token_budget, num_free_slots)
        return self._grant(entry.request_id, state, num_cached, num_new)

    def _grant(
        self, request_id: str, state: _RequestBlocks, num_cached: int, num_new: int
    ) -> WaitingGrant:
        self._publish_full_blocks(state, num_cached + num_new)
        return WaitingGrant(request_id, tuple(state.block_ids), num_cached, num_new)

    def _release(self, held: Holds) -> None:
        """Free holds this allocation did not reach; their blocks stay cached (loading)."""
        for request_id in held.request_ids():
            state = self._requests.pop(request_id)
            self._waiting_hashes[request_id] = state.block_hashes
            self.pool.free(reversed(state.block_ids))

    def _allocate_blocks(self, num_blocks: int) -> list[int]:
        block_ids = self.pool.allocate(num_blocks)
        if self.offload is not None:
            evicted = self.pool.evicted
            if evicted:
                self.offload.save_evicted(evicted)
                evicted.clear()
            self.offload.reuse(block_ids)
        return block_ids

    def _load_offloaded(
        self, lookup: Lookup, hashes: Sequence[BlockHash], block_ids: Sequence[int]
    ) -> None:
        """Copy the tiers' hits into the request's new blocks and publish them now: whoever
        hits them while they load is held (`KVOffload.is_loading`)."""
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
