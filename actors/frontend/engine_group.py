"""A front end's engine cores as one: the single core of a usual server, or the N cores of
`tandem serve --data-parallel-size N`, each behind its own EngineClient.

    add_request -> the balancer picks a core (actors/frontend/dp_balancer.py) -> its client
    abort       -> the core each request went to (all cores for one it does not know)
    questions   -> every core, answers summed ('stats', 'reset_prefix_cache') or per core

No torch here, like the clients.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio

from actors.frontend.dp_balancer import DataParallelBalancer
from actors.frontend.engine_client import EngineClient, EngineUnavailable
from actors.frontend.output_stream import RequestStream
from actors.protocol.messages import (
    EngineRequest,
    KVTierStats,
    PrefixCacheReset,
    SchedulerStats,
)

_MIN_SWEEP_REQUESTS = 1024
"""The owner table is swept of finished requests once it is twice as large as after the
last sweep (and at least this large): amortised O(1) per request."""


class EngineGroup:
    def __init__(
        self, clients: Sequence[EngineClient], balancer: DataParallelBalancer | None = None
    ) -> None:
        if not clients:
            raise ValueError("an engine group needs at least one client")
        if len(clients) > 1 and (balancer is None or balancer.num_cores != len(clients)):
            raise ValueError("several engine cores need a balancer of as many cores")
        self.clients = tuple(clients)
        self.balancer = balancer
        self._owners: dict[str, tuple[int, RequestStream]] = {}
        self._sweep_at = _MIN_SWEEP_REQUESTS

    @property
    def num_cores(self) -> int:
        return len(self.clients)

    @property
    def has_tokenizer(self) -> bool:
        return self.clients[0].has_tokenizer

    @property
    def is_running(self) -> bool:
        return all(client.is_running for client in self.clients)

    @property
    def last_heard_at(self) -> float:
        """When the most silent core last sent anything: one stalled core stalls the
        server (app/engine_watchdog.py)."""
        return min(client.last_heard_at for client in self.clients)

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> RequestStream:
        if self.balancer is None:
            return self.clients[0].add_request(request)
        # Placeholder ids of a prompt of embeddings share no prefix worth following.
        prefix = () if request.prompt_embeds is not None else request.prompt_token_ids
        core = self.balancer.choose(prefix, request.cache_salt)
        stream = self.clients[core].add_request(request)
        self._owners[request.request_id] = (core, stream)
        if len(self._owners) >= self._sweep_at:
            self._sweep()
        return stream

    def core_of(self, request_id: str) -> int | None:
        """The core a request of this front end went to (None: unknown or long finished)."""
        if self.balancer is None:
            return 0
        owner = self._owners.get(request_id)
        return None if owner is None else owner[0]

    def abort(self, request_ids: list[str]) -> None:
        if self.balancer is None:
            self.clients[0].abort(request_ids)
            return
        by_core: dict[int | None, list[str]] = {}
        for request_id in request_ids:
            owner = self._owners.pop(request_id, None)
            by_core.setdefault(None if owner is None else owner[0], []).append(request_id)
        unknown = by_core.pop(None, [])
        for core, client in enumerate(self.clients):
            ids = by_core.get(core, []) + unknown  # a core ignores ids it does not hold
            if ids:
                client.abort(ids)

    def fail_all(self, message: str) -> None:
        for client in self.clients:
            client.fail_all(message)

    def _sweep(self) -> None:
        self._owners = {rid: o for rid, o in self._owners.items() if not o[1].finished}
        self._sweep_at = max(_MIN_SWEEP_REQUESTS, 2 * len(self._owners))

    # ---- questions ----------------------------------------------------------------------

    async def stats_by_core(self) -> list[SchedulerStats]:
        """Each core's load and KV usage, asked over the protocol (all at once)."""
        answers: list[SchedulerStats | None] = [None] * self.num_cores

        async def ask(core: int) -> None:
            result = await self.clients[core].call("stats")
            if result.stats is None:
                raise EngineUnavailable(result.error or "the engine core sent no stats")
            answers[core] = result.stats

        await _each(ask, self.num_cores)
        return [stats for stats in answers if stats is not None]

    async def stats(self) -> SchedulerStats:
        """The cores' stats summed (KV usage: of all their blocks together)."""
        return sum_stats(await self.stats_by_core())

    async def check_kv_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant of a core's KV cache."""
        errors: list[str] = []

        async def ask(core: int) -> None:
            result = await self.clients[core].call("check_kv_invariants")
            if result.error is not None:
                errors.append(
                    f"engine {core}: {result.error}" if self.num_cores > 1 else result.error
                )

        await _each(ask, self.num_cores)
        if errors:
            raise AssertionError(errors[0])

    async def reset_prefix_cache(self) -> PrefixCacheReset:
        """Every core drops the cached blocks no request holds."""
        resets: list[PrefixCacheReset] = []

        async def ask(core: int) -> None:
            result = await self.clients[core].call("reset_prefix_cache")
            if result.prefix_cache_reset is None:
                raise EngineUnavailable(result.error or "the engine core did not reset its cache")
            resets.append(result.prefix_cache_reset)

        await _each(ask, self.num_cores)
        return PrefixCacheReset(
            sum(r.num_dropped_blocks for r in resets),
            sum(r.num_kept_blocks for r in resets),
            sum(r.num_dropped_offloaded_blocks for r in resets),
        )

    def close(self) -> None:
        for client in self.clients:
            client.close()


async def _each(ask: Callable[[int], Coroutine[Any, Any, None]], num_cores: int) -> None:
    """Run `ask(core)` for every core at once; the first error wins (unwrapped)."""
    try:
        async with anyio.create_task_group() as tg:
            for core in range(num_cores):
                tg.start_soon(ask, core)
    except ExceptionGroup as group:
        raise group.exceptions[0] from None


def sum_stats(per_core: Sequence[SchedulerStats]) -> SchedulerStats:
    total_blocks = sum(s.num_total_kv_blocks for s in per_core)
    free_blocks = sum(s.num_free_kv_blocks for s in per_core)
    rows = [s.num_free_rows for s in per_core]
    return SchedulerStats(
        num_running=sum(s.num_running for s in per_core),
        num_waiting=sum(s.num_waiting for s in per_core),
        num_preemptions_total=sum(s.num_preemptions_total for s in per_core),
        num_total_kv_blocks=total_blocks,
        num_free_kv_blocks=free_blocks,
        kv_usage_perc=(
            per_core[0].kv_usage_perc
            if len(per_core) == 1
            else sum(s.kv_usage_perc * s.num_total_kv_blocks for s in per_core)
            / max(1, total_blocks)
        ),
        prefix_cache_queries_tokens=sum(s.prefix_cache_queries_tokens for s in per_core),
        prefix_cache_hits_tokens=sum(s.prefix_cache_hits_tokens for s in per_core),
        num_free_rows=None if None in rows else sum(r for r in rows if r is not None),
        kv_tiers=_sum_tiers([s.kv_tiers for s in per_core]),
    )


def _sum_tiers(per_core: Sequence[tuple[KVTierStats, ...]]) -> tuple[KVTierStats, ...]:
    """Each offload tier's counts over the cores (every core has the same tiers)."""
    if len(per_core) == 1:
        return per_core[0]
    return tuple(
        KVTierStats(
            tiers[0].tier,
            *(sum(getattr(t, name) for t in tiers) for name in _TIER_COUNTS),
        )
        for tiers in zip(*per_core, strict=False)
    )


_TIER_COUNTS = (
    "queries_tokens",
    "hits_tokens",
    "saved_bytes",
    "loaded_bytes",
    "num_blocks",
    "num_capacity_blocks",
)
