"""The engine core and one front-end client on the caller's event loop, joined by an
in-process endpoint: what the offline `LLM`, the benchmarks and the tests run. The same
protocol messages cross as between processes (`roundtrip=True` even encodes them)."""

from __future__ import annotations

import collections
from typing import Any

import anyio

from actors.core.engine_core import EngineCore
from actors.core.kv_claims import KeptPrefixCache
from actors.frontend.engine_client import EngineClient
from actors.frontend.output_stream import RequestStream
from actors.protocol.config import EngineConfig
from actors.protocol.messages import EngineReady, EngineRequest, StepStats
from actors.protocol.transport import InProcessChannel

MAX_RECENT_STEP_STATS = 100_000


class InProcessEngine:
    def __init__(
        self,
        worker: Any,
        runner_choice: Any,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        roundtrip: bool = False,
        warm_up: bool = False,
        max_consecutive_failed_steps: int = 5,
        kept_prefix_cache: KeptPrefixCache | None = None,
        **client_callbacks: Any,
    ) -> None:
        """`kept_prefix_cache`: an earlier core's prefix cache to go on with (EngineCore's).
        `client_callbacks`: the EngineClient's on_request_finished, step_observers,
        on_scheduler_stats and on_dead."""
        self._channel = InProcessChannel(roundtrip=roundtrip)
        self.core = EngineCore(
            worker,
            runner_choice,
            self._channel.core,
            config,
            max_consecutive_failed_steps=max_consecutive_failed_steps,
            kept_prefix_cache=kept_prefix_cache,
        )
        self.step_stats: collections.deque[StepStats] = collections.deque(
            maxlen=MAX_RECENT_STEP_STATS
        )
        """The latest steps' stats, as the front end hears them (offline runs report them)."""
        observers = (*client_callbacks.pop("step_observers", ()), self.step_stats.append)
        self.client = EngineClient(
            self._channel.clients[0],
            tokenizer,
            on_ready=self._on_ready,
            step_observers=observers,
            **client_callbacks,
        )
        self._warm_up = warm_up
        self._ready: anyio.Event | None = None

    @property
    def ready(self) -> EngineReady | None:
        return self.client.ready

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until `stop()`; `started` once the core has answered the client's hello.
        On stop the core aborts what is left and drains, then the client's streams end."""
        self._ready = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(self.client.run)
            await tg.start(self._run_core)
            await self._ready.wait()
            task_status.started()

    async def _run_core(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await self.core.run(warm_up=self._warm_up, task_status=task_status)
        finally:
            self._channel.core.close()  # ends the client's receive loop

    def _on_ready(self, ready: EngineReady) -> None:
        if self._ready is not None:
            self._ready.set()

    def add_request(self, request: EngineRequest) -> RequestStream:
        return self.client.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.client.abort(request_ids)

    def stop(self) -> None:
        self.core.stop()

    def recent_step_stats(self) -> tuple[StepStats, ...]:
        return tuple(self.step_stats)

    @property
    def num_preemptions_total(self) -> int:
        return self.core.scheduler.num_preemptions_total
