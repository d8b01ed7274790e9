"""The engine cores one front end serves from: one, or `--data-parallel-size N` of them,
started, watched and stopped together, behind one EngineGroup.

Each core is an EngineConnection of its own (app/engine_connection.py): a process this
front end starts (one API server; each core gets its own ipc folder and launch secret),
a process the supervisor started (several API servers), or, for one core only, a core on
this event loop (a preloaded model). Core i is started with data_parallel_rank i, which
on CUDA places it on cuda:i (gpu/distributed/dp_placement.py).

A core that fails to start fails the start of them all (the others are stopped); a core
that dies later marks the server dead, as the one core of a usual server does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import structlog

from actors.frontend.dp_balancer import DataParallelBalancer
from actors.frontend.engine_group import EngineGroup
from actors.frontend.prefix_affinity import PrefixAffinity
from actors.protocol.config import EngineConfig
from actors.protocol.messages import EngineReady
from app.engine_connection import (
    EngineAttachment,
    EngineCallbacks,
    EngineConnection,
    EngineStartError,
    ProcessOptions,
)
from telemetry.logging import EngineStatsLog
from telemetry.metrics import EngineMetrics


class EngineCores:
    def __init__(
        self,
        config: EngineConfig,
        callbacks: Callable[[int], EngineCallbacks],
        *,
        preloaded: Any = None,
        attach: Sequence[EngineAttachment] = (),
        process_options: ProcessOptions = ProcessOptions(),
        affinity: PrefixAffinity | None = None,
        client_index: int = 0,
    ) -> None:
        """`callbacks(i)`: what core i's client reports to. `attach`: one attachment per
        core (the supervisor's processes). `affinity`: the prefix table this front end
        shares with the other API servers (default: its own)."""
        num_cores = config.data_parallel_size
        if preloaded is not None and num_cores > 1:
            raise EngineStartError(
                "--data-parallel-size above 1 runs engine-core processes; a preloaded "
                "model serves one core",
                is_user_error=True,
            )
        if attach and len(attach) != num_cores:
            raise ValueError(f"{len(attach)} engine attachments for {num_cores} cores")
        self.balancer = (
            DataParallelBalancer(num_cores, config.block_size, affinity, first_turn=client_index)
            if num_cores > 1
            else None
        )
        self.connections = [
            EngineConnection(
                config.replace(data_parallel_rank=core) if num_cores > 1 else config,
                self._with_load(callbacks(core), core),
                preloaded=preloaded,
                attach=attach[core] if attach else None,
                process_options=process_options,
            )
            for core in range(num_cores)
        ]
        self.client: EngineGroup | None = None
        """Every core's client as one, once all are ready."""
        self.ready: EngineReady | None = None
        """Core 0's EngineReady (the cores run one configuration)."""
        self._stopped = False

    def _with_load(self, callbacks: EngineCallbacks, core: int) -> EngineCallbacks:
        if self.balancer is None:
            return callbacks
        return dataclasses.replace(callbacks, on_load=functools.partial(self.balancer.report, core))

    @property
    def inprocess_engine(self) -> Any:
        """The in-process engine of a one-core server on a preloaded model (None otherwise)."""
        return self.connections[0].inprocess_engine

    @property
    def inprocess_core(self) -> Any:
        return self.connections[0].inprocess_core

    @property
    def engine_pids(self) -> list[int | None]:
        return [connection.engine_pid for connection in self.connections]

    def spawn(self) -> None:
        """Start the cores' processes now (those this front end owns), so that they load
        the model while the front end loads its tokenizer."""
        for connection in self.connections:
            connection.spawn()

    async def run(self, tokenizer: Any, *, task_status: anyio.abc.TaskStatus[EngineReady]) -> None:
        """Start (or attach to) every core; `started` with core 0's EngineReady once all are
        ready. Raises EngineStartError if one cannot start (the others are stopped). Then
        runs until `shutdown()`."""
        async with anyio.create_task_group() as tg:
            try:
                readies = [await tg.start(c.run, tokenizer) for c in self.connections]
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.shutdown()
                raise
            clients = [c.client for c in self.connections if c.client is not None]
            assert len(clients) == len(self.connections)  # every core answered ready
            self.client = EngineGroup(clients, self.balancer)
            self.ready = readies[0]
            task_status.started(readies[0])

    async def shutdown(self) -> None:
        """Stop every core this front end owns, all at once (after the drain)."""
        if self._stopped:
            return
        self._stopped = True
        async with anyio.create_task_group() as tg:
            for connection in self.connections:
                tg.start_soon(connection.shutdown)


def core_callbacks(
    metrics: EngineMetrics, num_cores: int, on_dead: Callable[[str], None]
) -> Callable[[int], EngineCallbacks]:
    """What core i's client reports to: its own metric series (engine="i") and stats log;
    any core's death to `on_dead`."""

    def callbacks(core: int) -> EngineCallbacks:
        logger = structlog.get_logger("tandem.engine")
        stats_log = EngineStatsLog(logger.bind(engine=core) if num_cores > 1 else logger)
        return EngineCallbacks(
            on_request_finished=functools.partial(
                metrics.observe_request_finished, engine_index=core
            ),
            step_observers=(
                functools.partial(metrics.observe_step, engine_index=core),
                stats_log.observe_step,
            ),
            on_scheduler_stats=functools.partial(metrics.observe_engine_totals, engine_index=core),
            on_dead=on_dead,
            on_predecessor_aborted=functools.partial(
                metrics.record_predecessor_aborts, engine_index=core
            ),
        )

    return callbacks
