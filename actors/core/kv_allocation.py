"""What the scheduler asks of the KV cache manager each step (AllocateStep: free, grow the
running requests, admit waiting ones) and what it gets back (StepAllocation, KVUsage)."""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass

from actors.protocol.messages import KVTierStats


@dataclass(frozen=True, slots=True)
class RunningAllocs:
    """Make each running request's blocks hold its `num_tokens` tokens (computed + scheduled
    this step), as columns in batch order (one message carries a whole batch, so no object
    per request). Idempotent: asking again for the same or fewer tokens allocates nothing."""

    request_ids: tuple[str, ...] = ()
    num_tokens: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True, slots=True)
class WaitingAlloc:
    """First allocation of a request entering the batch: new, or resumed after preemption
    (then `token_ids` is the prompt plus every output token so far)."""

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    max_num_new_tokens: int
    """Upper bound on the tokens scheduled this step, before the step's token budget."""
    cache_salt: str | None = None
    reuse_cached_prefix: bool = True
    """False: compute every token (a request that wants its prompt's logprobs); its full
    blocks are still offered to later requests."""


@dataclass(frozen=True, slots=True)
class AllocateStep:
    """One step's allocation, applied in order:

    1. free the blocks of `free_request_ids`;
    2. allocate `running` in order, stopping at the first entry that cannot get its blocks
       (entries before it keep theirs);
    3. only if every running entry succeeded, admit `waiting` in order while
       `token_budget` (tokens left for waiting requests) lasts, stopping at the first entry
       that does not fit. An entry whose blocks are being loaded from the offload tiers, or
       read from disk, gets no grant yet; the entries after it go on (its grant comes in a
       later allocation: actors/core/kv_cache_manager.py).
    """

    free_request_ids: tuple[str, ...]
    running: RunningAllocs
    waiting: tuple[WaitingAlloc, ...]
    token_budget: int


@dataclass(frozen=True, slots=True)
class WaitingGrant:
    request_id: str
    block_ids: tuple[int, ...]
    """The request's whole block table: prefix-cache hits first, then new blocks."""
    num_cached_tokens: int
    """Tokens whose KV is already in the cache; the request computes from here."""
    num_new_tokens: int
    """Tokens scheduled this step."""


@dataclass(frozen=True, slots=True)
class StepAllocation:
    num_running_ok: int
    """Running entries (a prefix of AllocateStep.running) that got their blocks."""
    new_block_ids: tuple[tuple[int, ...], ...]
    """Per satisfied running entry, the blocks appended to its table by this call."""
    waiting: tuple[WaitingGrant, ...]
    """Per admitted waiting entry, in AllocateStep.waiting's order."""
    usage: KVUsage | None = None
    """The cache's usage after this allocation (for the step's stats)."""


@dataclass(frozen=True, slots=True)
class KVUsage:
    num_total_blocks: int
    num_free_blocks: int
    """Blocks no request holds (never used, or evictable cached blocks)."""
    num_used_blocks: int
    """Blocks held by at least one request."""
    num_cached_blocks: int
    """Blocks registered in the prefix cache, held or evictable."""
    usage_perc: float
    """num_used_blocks / num_total_blocks, in [0, 1] (Prometheus kv_cache_usage_perc)."""
    prefix_cache_queries_tokens: int
    """Tokens looked up in the prefix cache by admitted requests, cumulative."""
    prefix_cache_hits_tokens: int
    """Of those, tokens found in the cache, cumulative."""
    kv_tiers: tuple[KVTierStats, ...] = ()
    """The offload tiers behind the device pool (host memory, disk), when on."""


def validate_allocate_step(
    msg: AllocateStep, holders: Mapping[str, object], held: Container[str]
) -> None:
    """Raise ValueError for a malformed allocation. `holders`: the requests holding blocks;
    `held`: those among them that wait for their loads (listed as waiting, not running)."""
    if msg.token_budget < 0:
        raise ValueError(f"token_budget must be >= 0, got {msg.token_budget}")
    freed = set(msg.free_request_ids)
    running_ids = _validate_running(msg.running, freed, holders, held)
    waiting_ids: set[str] = set()
    for entry in msg.waiting:
        request_id = entry.request_id
        holds = request_id in holders and request_id not in freed and request_id not in held
        if holds or request_id in running_ids or request_id in waiting_ids:
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


def _validate_running(
    running: RunningAllocs, freed: set[str], holders: Mapping[str, object], held: Container[str]
) -> set[str]:
    """The running entries' ids; checked as whole columns, since a batch holds many."""
    request_ids = running.request_ids
    running_ids = set(request_ids)
    if len(running.num_tokens) != len(request_ids):
        raise ValueError(
            f"{len(request_ids)} running requests but {len(running.num_tokens)} token counts"
        )
    if not running_ids <= holders.keys() or not running_ids.isdisjoint(freed):
        request_id = next(r for r in request_ids if r not in holders or r in freed)
        raise ValueError(f"running request {request_id!r} holds no blocks")
    if any(request_id in held for request_id in request_ids):
        request_id = next(r for r in request_ids if r in held)
        raise ValueError(f"running request {request_id!r} waits for its loads")
    if len(running_ids) != len(request_ids):
        request_id = next(r for i, r in enumerate(request_ids) if r in request_ids[:i])
        raise ValueError(f"running request {request_id!r} is listed twice")
    if request_ids and min(running.num_tokens) < 0:
        request_id = request_ids[running.num_tokens.index(min(running.num_tokens))]
        raise ValueError(f"running request {request_id!r}: num_tokens must be >= 0")
    return running_ids
