"""`tandem serve --api-server-count N`: one engine-core process (or one per core of
`--data-parallel-size`) and N API-server processes sharing one listening socket, watched by
this (torch-free) parent.

    supervisor --binds--> the socket, inherited by every API server, which take their
      |                   shares of its connections by their counts of open ones
      |                   (app/connection_balance.py, in a file of the ipc folder)
      |-- engine core   (python -m actors.core.engine_core_proc; engine core i of
      |                  --data-parallel-size at engine-i.sock, each API server connected
      |                  to every one, and sharing one prefix-affinity table file)
      |-- api server 0  (python -m app.api_server_proc)  records each step's timings
      |-- ...
      '-- api server N-1

- Metrics: the API servers run Prometheus multiprocess mode in a private directory, so
  /metrics from any of them sums the whole server.
- SIGTERM/SIGINT: forwarded to every API server, which drains as a single server does
  (a second signal is forwarded too: abort now); once all have exited the core is told to
  shut down. Exit code 0, or the API servers' worst.
- An API server that dies is restarted (its requests are aborted in the core when the new
  one says hello); more than MAX_RESTARTS in RESTART_WINDOW_S and the server exits 1.
- An API server that stops answering (SIGSTOP, or its event loop blocked) is found by its
  silence on a heartbeat pipe (app/heartbeat_pipe.py): silent for --api-server-stall-timeout
  seconds, it is logged (api_server_unresponsive), SIGKILLed and restarted like one that
  died (its connections are reset; while it is silent, the others accept every new
  connection). While draining it is killed and not restarted, and the exit code is 1.
- An engine core dying is seen by every API server at once (/health 503 'dead').
- Every child dies with the supervisor (PR_SET_PDEATHSIG): no orphans.
- The engine core serves only peers that present this launch's secret, which every child
  gets on its stdin (actors/protocol/launch_secret.py); the supervisor presents it too, to send
  Shutdown. The ipc folder (0700) lives as long as the supervisor: a restarted API server
  connects again. It is removed however the supervisor exits, SIGKILL aside.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque

import msgspec
import structlog

from actors.frontend.prefix_affinity import PrefixAffinity
from actors.protocol.launch_secret import new_secret, start_with_secret
from actors.protocol.transport import ipc_address, send_shutdown
from app.connection_balance import ConnectionLoads
from app.engine_process import start_engine_process, stop_process
from app.heartbeat_pipe import HeartbeatReader
from app.serve_settings import ServeSettings
from app.server import bind_listening_socket

log = structlog.get_logger("tandem.supervisor")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
_POLL_S = 0.1
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Supervisor:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.sock = bind_listening_socket(settings.host, settings.port)
        self.port: int = self.sock.getsockname()[1]
        self._workdir = tempfile.mkdtemp(prefix="tandem-")
        self._metrics_dir = os.path.join(self._workdir, "metrics")
        os.mkdir(self._metrics_dir)
        self._loads_path = os.path.join(self._workdir, "connection_loads")
        ConnectionLoads.create(self._loads_path, settings.api_server_count)
        num_cores = settings.engine.data_parallel_size
        self._affinity_path = os.path.join(self._workdir, "prefix_affinity")
        if num_cores > 1:
            PrefixAffinity.create(self._affinity_path)
        self._addresses = [ipc_address(self._workdir, core) for core in range(num_cores)]
        self._secret = new_secret()
        self._engines: list[subprocess.Popen[bytes]] = []
        self._api_servers: dict[int, subprocess.Popen[bytes]] = {}
        self._heartbeats: dict[int, HeartbeatReader] = {}
        self._killed_silent: set[int] = set()  # pids killed for their silence
        self._restarts: deque[float] = deque()
        self._signals: deque[int] = deque()
        self._draining = False
        self.exit_code = 0

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda signum, frame: self._signals.append(signum))
        settings = self.settings
        try:
            config, num_cores = settings.engine, len(self._addresses)
            for core, address in enumerate(self._addresses):
                self._engines.append(
                    start_engine_process(
                        config.replace(data_parallel_rank=core) if num_cores > 1 else config,
                        address,
                        self._secret,
                        max_consecutive_failed_steps=settings.max_consecutive_failed_steps,
                        log_format=settings.log_format,
                        log_level=settings.log_level,
                    )
                )
            for index in range(settings.api_server_count):
                self._api_servers[index] = self._start_api_server(index)
            host = f"[{settings.host}]" if ":" in settings.host else settings.host
            log.info(
                "server_listening",
                url=f"http://{host}:{self.port}",
                model=settings.engine.model,
                api_servers=settings.api_server_count,
                engine_pid=self._engines[0].pid,
                **({"engine_pids": [e.pid for e in self._engines]} if num_cores > 1 else {}),
            )
            self._supervise()
        finally:
            try:
                self._stop_engine()
            finally:
                shutil.rmtree(self._workdir, ignore_errors=True)
        return self.exit_code

    def _supervise(self) -> None:
        while self._api_servers:
            while self._signals:
                self._forward(self._signals.popleft())
            for index, process in list(self._api_servers.items()):
                returncode = process.poll()
                if returncode is not None:
                    self._on_api_server_exit(index, process, returncode)
                else:
                    self._check_heartbeat(index, process)
            time.sleep(_POLL_S)

    def _check_heartbeat(self, index: int, process: subprocess.Popen[bytes]) -> None:
        reader = self._heartbeats.get(index)
        if reader is None or process.pid in self._killed_silent:
            return
        now = time.monotonic()
        reader.read(now)
        if reader.is_silent_too_long(now):
            log.error(
                "api_server_unresponsive",
                index=index,
                pid=process.pid,
                silent_s=round(reader.silent_s(now), 3),
                stall_timeout_s=reader.stall_timeout_s,
            )
            self._killed_silent.add(process.pid)
            process.kill()  # a stopped process dies of SIGKILL too

    def _forward(self, signum: int) -> None:
        log.info(
            "draining" if not self._draining else "second_signal_aborting_requests",
            signal=signal.Signals(signum).name,
        )
        self._draining = True
        for process in self._api_servers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    def _on_api_server_exit(
        self, index: int, process: subprocess.Popen[bytes], returncode: int
    ) -> None:
        del self._api_servers[index]
        reader = self._heartbeats.pop(index, None)
        if reader is not None:
            reader.close()
        _mark_process_dead(process.pid, self._metrics_dir)
        if process.pid in self._killed_silent:
            self._killed_silent.discard(process.pid)
            returncode = 1  # not the SIGKILL's -9: an unresponsive server is a failure
        if self._draining:
            self.exit_code = max(self.exit_code, returncode)
            return
        if returncode == 2:  # the configuration is at fault (it printed why): stop all
            log.error("api_server_failed_to_start", index=index)
            self.exit_code = 2
            self._forward(signal.SIGTERM)
            return
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= MAX_RESTARTS:
            log.error("api_server_restarts_exhausted", index=index, returncode=returncode)
            self.exit_code = 1
            self._forward(signal.SIGTERM)
            return
        log.error("api_server_died_restarting", index=index, pid=process.pid, returncode=returncode)
        self._restarts.append(now)
        self._api_servers[index] = self._start_api_server(index)

    def _start_api_server(self, index: int) -> subprocess.Popen[bytes]:
        cores = [
            arg
            for address, engine in zip(self._addresses, self._engines)
            for arg in ("--engine-address", address, "--engine-pid", str(engine.pid))
        ]
        if len(self._engines) > 1:
            cores += ["--prefix-affinity", self._affinity_path]
        command = [
            sys.executable,
            "-m",
            "app.api_server_proc",
            "--fd",
            str(self.sock.fileno()),
            "--client-index",
            str(index),
            *cores,
            "--settings",
            msgspec.json.encode(self.settings).decode(),
            "--parent-pid",
            str(os.getpid()),
            "--connection-loads",
            self._loads_path,
        ]
        env = {
            **os.environ,
            MULTIPROC_DIR_ENV: self._metrics_dir,
            "TANDEM_PROCESS_NAME": f"api_server_{index}",
        }
        stall_timeout_s = self.settings.api_server_stall_timeout_s
        if stall_timeout_s <= 0:
            return self._spawn(command, env)
        read_fd, write_fd = os.pipe()
        try:
            process = self._spawn([*command, "--heartbeat-fd", str(write_fd)], env, write_fd)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the child holds it now
        self._heartbeats[index] = HeartbeatReader(read_fd, time.monotonic(), stall_timeout_s)
        return process

    def _spawn(self, command: list[str], env: dict[str, str], *fds: int) -> subprocess.Popen[bytes]:
        # A session of its own: a terminal's Ctrl-C reaches the supervisor alone, which
        # forwards one signal (two would skip the drain).
        return start_with_secret(
            command,
            self._secret,
            pass_fds=(self.sock.fileno(), *fds),
            env=env,
            start_new_session=True,
        )

    def _stop_engine(self) -> None:
        """Ask every core still running to shut down, then wait for them all (a core that
        never started is not waited for)."""
        running = [(a, e) for a, e in zip(self._addresses, self._engines) if e.poll() is None]
        for address, _ in running:
            send_shutdown(address, self._secret)
        for _, engine in running:
            stop_process(engine, timeout_s=30.0)
        if any(e.returncode not in (0, None) for e in self._engines) and self.exit_code == 0:
            self.exit_code = 1


def _mark_process_dead(pid: int, directory: str) -> None:
    """Drop a dead API server's live gauges from the merged metrics (its counters stay)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path=directory)
