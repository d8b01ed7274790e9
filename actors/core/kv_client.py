"""The scheduler's handle on the KV cache actor: every call is a mailbox message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from actors.core.kv_cache_manager import KVCacheActor
from actors.core.kv_messages import AllocateStep, FreeRequests, StepAllocation


class KVClient(Protocol):
    """What the scheduler asks of the KV cache (KVActorClient, or a direct one in tests)."""

    async def allocate_step(self, msg: AllocateStep) -> StepAllocation: ...

    async def free(self, request_ids: Sequence[str]) -> None: ...


class KVActorClient:
    def __init__(self, actor: KVCacheActor) -> None:
        self._actor = actor

    async def allocate_step(self, msg: AllocateStep) -> StepAllocation:
        return await self._actor.ask(msg)

    async def free(self, request_ids: list[str] | tuple[str, ...]) -> None:
        self._actor.tell(FreeRequests(tuple(request_ids)))
