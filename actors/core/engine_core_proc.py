"""The engine core's own process (`python -m actors.core.engine_core_proc`, started by
`tandem serve`): load the model, warm up, then serve the protocol on a ZMQ ipc socket.

It ignores SIGINT and SIGTERM: a terminal's Ctrl-C or a container stop reaches every
process of the group, and the core must keep running while the front ends drain; they
send Shutdown when they are done. It dies with its parent (PR_SET_PDEATHSIG), so no core
outlives the server that started it.

It reads the launch secret on stdin (actors/protocol/launch_secret.py) and serves only peers that
present it. From the moment it binds until it exits, a task on its event loop sends every
front end a Heartbeat, so a front end notices a core that is stopped or whose loop is
blocked (app/engine_watchdog.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import anyio
import msgspec
import structlog

from actors.protocol import event_loop
from actors.protocol.config import EngineConfig
from actors.protocol.launch_secret import read_secret
from actors.protocol.messages import (
    HEARTBEAT_INTERVAL_S,
    ClientHello,
    EngineStartupFailed,
    Heartbeat,
    Shutdown,
)
from actors.protocol.parent_death import die_with_parent
from actors.protocol.transport import TransportClosed, ZmqCoreEndpoint
from gpu.cpu_threads import set_quiet_openmp_env

log = structlog.get_logger("tandem.engine_core")

_FAILURE_FLUSH_S = 0.5
"""How long a failed start waits for its EngineStartupFailed to leave the socket."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    set_quiet_openmp_env()  # read once, as torch loads its OpenMP runtime
    die_with_parent(args.parent_pid)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    from telemetry.logging import configure_logging

    configure_logging(  # engine_core, or engine_core_<i> of --data-parallel-size N
        json=args.log_format == "json",
        level=args.log_level,
        process_name=os.environ.get("TANDEM_PROCESS_NAME") or "engine_core",
    )
    config = msgspec.json.decode(args.config.encode(), type=EngineConfig)
    return event_loop.run(
        _serve, config, args.address, read_secret(), args.max_consecutive_failed_steps
    )


async def _serve(
    config: EngineConfig, address: str, secret: bytes, max_consecutive_failed_steps: int
) -> int:
    started = time.perf_counter()
    endpoint = ZmqCoreEndpoint(address, secret)
    built: list[Any] = []  # the EngineCore, once built: the heartbeats carry its load
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_heartbeats, endpoint, built)
            exit_code = await _load_and_run(
                config, endpoint, started, max_consecutive_failed_steps, built
            )
            tg.cancel_scope.cancel()
        return exit_code
    finally:
        endpoint.close()


async def _load_and_run(
    config: EngineConfig,
    endpoint: ZmqCoreEndpoint,
    started: float,
    max_consecutive_failed_steps: int,
    built: list[Any],
) -> int:
    clients: set[int] = set()
    shutdown = anyio.Event()
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_greet_while_loading, endpoint, clients, shutdown)
        try:
            loaded = await anyio.to_thread.run_sync(_load, config)
        except Exception as exc:  # noqa: BLE001 - reported to the front ends, then exit
            failure = exc
        tg.cancel_scope.cancel()  # the greeter never returns on its own
    if failure is not None:
        return await _report_failure(endpoint, clients, failure)
    if shutdown.is_set():
        return 0
    from actors.core.engine_core import EngineCore

    try:
        core = EngineCore(
            loaded.worker,
            loaded.runner,
            endpoint,
            config,
            max_consecutive_failed_steps=max_consecutive_failed_steps,
            started_at=started,
            known_clients=clients,
        )
        built.append(core)
        await core.run(warm_up=loaded.worker.device.type == "cuda")
    finally:
        loaded.worker.close()  # tensor-parallel workers stop with the core
    return 1 if core.dead_reason is not None else 0


async def _send_heartbeats(endpoint: ZmqCoreEndpoint, built: list[Any]) -> None:
    """From this event loop, not a thread of its own: a loop that stops turning must fall
    silent (steps run on the GPU actor's threads, so a long one does not delay this).
    Once the core is built each heartbeat carries its load."""
    while True:
        for client_index in endpoint.client_indices:
            endpoint.send(client_index, Heartbeat(built[0].load(client_index) if built else None))
        await anyio.sleep(HEARTBEAT_INTERVAL_S)


async def _greet_while_loading(
    endpoint: ZmqCoreEndpoint, clients: set[int], shutdown: anyio.Event
) -> None:
    """Note who connects while the model loads; nothing else can arrive before ready."""
    while True:
        try:
            message = await endpoint.receive()
        except TransportClosed:
            return
        if isinstance(message, ClientHello) and message.client_index is not None:
            clients.add(message.client_index)
        elif isinstance(message, Shutdown):
            shutdown.set()


def _load(config: EngineConfig):
    from actors.core.engine_startup import load_engine

    return load_engine(config, frontends_share_host=True)


async def _report_failure(endpoint: ZmqCoreEndpoint, clients: set[int], exc: Exception) -> int:
    from actors.core.engine_startup import load_errors

    is_user_error = isinstance(exc, load_errors())
    if is_user_error:
        log.error("model_load_failed", error=str(exc))
    else:
        log.exception("engine_start_failed")
    failure = EngineStartupFailed(str(exc) or type(exc).__name__, is_user_error)
    for client in clients:
        endpoint.send(client, failure)
    await anyio.sleep(_FAILURE_FLUSH_S)
    return 2 if is_user_error else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m actors.core.engine_core_proc",
        description="tandem's engine core process (started by `tandem serve`)",
    )
    parser.add_argument("--address", required=True, help="ZMQ address to bind (ipc://...)")
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    parser.add_argument("--max-consecutive-failed-steps", type=int, default=5)
    parser.add_argument("--log-format", choices=("json", "console"), default="json")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--parent-pid", type=int, default=None)
    return parser


if __name__ == "__main__":
    sys.exit(main())
