"""One API-server process of `tandem serve --api-server-count N`
(`python -m app.api_server_proc`, started by the supervisor): Hypercorn on the listening
socket it inherits, in front of the engine core the supervisor started, or every core of
--data-parallel-size (whose sockets ask for the launch secret the supervisor writes to
this process's stdin). No torch."""

from __future__ import annotations

import argparse
import socket
import sys
from typing import TYPE_CHECKING

import anyio
import msgspec

from actors.frontend.prefix_affinity import PrefixAffinity
from actors.protocol import event_loop
from actors.protocol.launch_secret import read_secret
from actors.protocol.parent_death import die_with_parent
from app.connection_balance import ConnectionLoads
from app.engine_connection import EngineAttachment
from app.heartbeat_pipe import send_heartbeats
from app.serve_settings import ServeSettings

if TYPE_CHECKING:
    from app.server import TandemServer


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    die_with_parent(args.parent_pid)
    settings = msgspec.json.decode(args.settings.encode(), type=ServeSettings)
    from app.server import TandemServer
    from app.server_state import ServerState
    from telemetry.logging import configure_logging

    configure_logging(
        json=settings.log_format == "json",
        level=settings.log_level,
        process_name=f"api_server_{args.client_index}",
    )
    if len(args.engine_address) != len(args.engine_pid):
        raise SystemExit("give one --engine-pid per --engine-address")
    secret = read_secret()
    attach = [
        EngineAttachment(address, pid, args.client_index, secret)
        for address, pid in zip(args.engine_address, args.engine_pid)
    ]
    sock = socket.socket(fileno=args.fd)
    loads = None
    if args.connection_loads is not None:
        loads = ConnectionLoads(args.connection_loads, args.client_index)
    affinity = None if args.prefix_affinity is None else PrefixAffinity.open(args.prefix_affinity)
    state = ServerState(settings, attach=attach, affinity=affinity)
    server = TandemServer(settings, state, sock=sock, connection_loads=loads)
    exit_code: int = event_loop.run(_serve, server, args.heartbeat_fd)
    if server.state.failure_message is not None:
        print(f"tandem: error: {server.state.failure_message}", file=sys.stderr)
        return 2
    return exit_code


async def _serve(server: TandemServer, heartbeat_fd: int | None) -> int:
    """Serve, beating on the supervisor's heartbeat pipe meanwhile (app/heartbeat_pipe.py)."""
    async with anyio.create_task_group() as tg:
        if heartbeat_fd is not None:
            tg.start_soon(send_heartbeats, heartbeat_fd)
        exit_code = await server.serve()
        tg.cancel_scope.cancel()
    return exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.api_server_proc",
        description="one API server of `tandem serve --api-server-count N` (started by it)",
    )
    parser.add_argument("--fd", type=int, required=True, help="the inherited listening socket")
    parser.add_argument("--client-index", type=int, required=True)
    parser.add_argument(
        "--engine-address", action="append", required=True, help="an engine core's socket"
    )
    parser.add_argument(
        "--engine-pid", action="append", type=int, required=True, help="that core's pid"
    )
    parser.add_argument(
        "--prefix-affinity", help="the API servers' shared prefix-affinity table (a file)"
    )
    parser.add_argument("--settings", required=True, help="the ServeSettings as JSON")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--heartbeat-fd", type=int, help="the supervisor's heartbeat pipe")
    parser.add_argument(
        "--connection-loads", help="the API servers' shared connection counts (a file)"
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
