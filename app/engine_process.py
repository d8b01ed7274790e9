"""The engine core as a process, seen from a front end: started (or attached to), watched,
told to shut down. The front end never imports torch; the core's process does
(`python -m actors.core.engine_core_proc`).

Death is noticed at once through a pidfd, which works for any process, not only children:
with several API servers the supervisor starts the core and each front end watches it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import anyio
import msgspec
import structlog

from actors.protocol.config import EngineConfig
from actors.protocol.launch_secret import start_with_secret

log = structlog.get_logger("tandem.engine_process")

ENGINE_CORE_MODULE = "actors.core.engine_core_proc"
_POLL_S = 0.1


def start_engine_process(
    config: EngineConfig,
    address: str,
    secret: bytes,
    *,
    max_consecutive_failed_steps: int,
    log_format: str,
    log_level: str,
) -> subprocess.Popen[bytes]:
    """Start the engine core's process bound to `address` (ZMQ ipc), serving the peers
    that present `secret` (handed over on its stdin). It dies with its parent
    (PR_SET_PDEATHSIG), ignores SIGINT/SIGTERM (the front end drains first, then sends
    Shutdown) and logs to the same stderr."""
    command = [
        sys.executable,
        "-m",
        ENGINE_CORE_MODULE,
        "--address",
        address,
        "--config",
        msgspec.json.encode(config).decode(),
        "--max-consecutive-failed-steps",
        str(max_consecutive_failed_steps),
        "--log-format",
        log_format,
        "--log-level",
        log_level,
        "--parent-pid",
        str(os.getpid()),
    ]
    name = engine_process_name(config)
    process = start_with_secret(
        command, secret, close_fds=True, env={**os.environ, "TANDEM_PROCESS_NAME": name}
    )
    log.info("engine_process_started", pid=process.pid, process_name=name)
    return process


def engine_process_name(config: EngineConfig) -> str:
    """What the core's log lines and spans call its process: engine_core, or engine_core_<i>
    for core i of --data-parallel-size N."""
    if config.data_parallel_size == 1:
        return "engine_core"
    return f"engine_core_{config.data_parallel_rank}"


async def wait_process_exit(pid: int) -> None:
    """Return once process `pid` has exited (at once if it is gone already)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (old kernel): poll
        while _alive(pid):
            await anyio.sleep(_POLL_S)
        return
    try:
        await anyio.wait_readable(pidfd)
    finally:
        os.close(pidfd)


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """Wait up to `timeout_s` for an exit the process was asked for, then kill it."""
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.poll() is None:
        log.warning("engine_process_killed", pid=process.pid, timeout_s=timeout_s)
        process.kill()
    return process.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
