"""Start one worker process per TP rank, watch them, stop them.

Workers are spawned, never forked (a forked child cannot use CUDA), with the
no-multicast environment (gpu/distributed/env.py). Each runs `target(rank, *args)`;
its return value, or the traceback of what it raised, travels back to the parent. A worker
also watches a pipe whose other end only the parent holds: when the parent dies the pipe
reaches end-of-file and the worker exits, so a crashed engine leaves no orphan workers.

The parent notices a rank that fails (an exception, a non-zero exit, a signal) or hangs
(not finished by the deadline), stops every other rank, and raises RankFailedError.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from gpu.distributed.env import apply_worker_env

STOP_GRACE_S = 5.0
FAILURE_REPORT_GRACE_S = 2.0
_PARENT_GONE_EXIT_CODE = 3


class RankFailedError(RuntimeError):
    """TP workers failed or hung. `failures` maps each rank seen failing to what happened;
    `rank` is the lowest of them."""

    def __init__(self, failures: dict[int, str], details: dict[int, str] | None = None) -> None:
        described = "; ".join(f"rank {rank} {reason}" for rank, reason in sorted(failures.items()))
        super().__init__(f"tensor-parallel worker failed: {described}")
        self.failures = failures
        self.rank = min(failures)
        self.details = details or {}
        """rank -> the traceback of what it raised."""


class WorkerGroup:
    """The processes of one TP group, as started by `start_workers`."""

    def __init__(
        self,
        processes: list[BaseProcess],
        result_conns: list[Connection],
        lifeline_conns: list[Connection],
        first_rank: int = 0,
    ) -> None:
        self.processes = processes
        """processes[i] runs rank first_rank + i."""
        self.first_rank = first_rank
        self._result_conns = result_conns
        self._lifeline_conns = lifeline_conns
        self._results: dict[int, Any] = {}

    @property
    def num_processes(self) -> int:
        return len(self.processes)

    @property
    def pids(self) -> list[int | None]:
        return [process.pid for process in self.processes]

    def wait(self, timeout_s: float) -> list[Any]:
        """Every spawned rank's return value, in rank order, once all have finished. Raises
        RankFailedError (after stopping every rank) if one fails or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        failures: dict[int, tuple[str, str]] = {}  # process index -> (reason, traceback)
        while len(self._results) + len(failures) < self.num_processes:
            remaining = deadline - time.monotonic()
            pending = [
                i for i in range(self.num_processes) if i not in self._results and i not in failures
            ]
            if remaining <= 0 or not wait(self._waitables(pending), timeout=remaining):
                if failures:
                    break
                self.stop()
                late = f"did not finish within {timeout_s:g} s"
                raise RankFailedError({self.first_rank + i: late for i in pending})
            for index in pending:
                failure = self._collect(index)
                if failure is not None:
                    failures[index] = failure
                    # The rank that failed first often tears its connections down before it
                    # reports, so its peers fail too: give every rank a moment to report.
                    deadline = min(deadline, time.monotonic() + FAILURE_REPORT_GRACE_S)
        if failures:
            self.stop()
            raise RankFailedError(
                {self.first_rank + i: reason for i, (reason, _) in failures.items()},
                {self.first_rank + i: trace for i, (_, trace) in failures.items() if trace},
            )
        for process in self.processes:
            process.join(STOP_GRACE_S)
        return [self._results[index] for index in range(self.num_processes)]

    def check_alive(self) -> None:
        """Raise RankFailedError if a rank has exited (a running group never exits on its
        own); never blocks. For an engine's health check."""
        exited = {
            self.first_rank + i: f"exited unexpectedly ({_describe_exit(process)})"
            for i, process in enumerate(self.processes)
            if process.exitcode is not None
        }
        if exited:
            self.stop()
            raise RankFailedError(exited)

    def stop(self) -> None:
        """Terminate every live rank (SIGTERM, then SIGKILL after a grace period) and
        release the pipes. Safe to call more than once."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                _continue(process)  # a stopped process acts on SIGTERM only once continued
        for process in self.processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in (*self._result_conns, *self._lifeline_conns):
            conn.close()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _waitables(self, indices: list[int]) -> list[Any]:
        return [w for i in indices for w in (self._result_conns[i], self.processes[i].sentinel)]

    def _collect(self, index: int) -> tuple[str, str] | None:
        """Take process `index`'s result if it has arrived; (reason, traceback) if it failed."""
        conn, process = self._result_conns[index], self.processes[index]
        if conn.poll():
            try:
                status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                status, payload = "exit", None
            if status == "ok":
                self._results[index] = payload
                return None
            if status == "error":
                last_line = payload.strip().splitlines()[-1] if payload.strip() else "an error"
                return f"raised {last_line}", payload
        if process.exitcode is not None:
            return f"exited without a result ({_describe_exit(process)})", ""
        return None


def start_workers(
    target: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), first_rank: int = 0
) -> WorkerGroup:
    """Spawn one process per rank in [first_rank, world_size), each running
    `target(rank, *args)`; first_rank = 1 leaves rank 0 to the caller's own process.
    `target` and `args` must be picklable (a module-level function)."""
    if not 0 <= first_rank < world_size:
        raise ValueError(f"need 0 <= first_rank < world_size, got {first_rank}, {world_size}")
    apply_worker_env()  # spawned children inherit the parent's environment
    context = multiprocessing.get_context("spawn")
    processes, result_conns, lifeline_conns = [], [], []
    try:
        for rank in range(first_rank, world_size):
            result_reader, result_writer = context.Pipe(duplex=False)
            lifeline_reader, lifeline_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                name=f"tandem-tp-rank{rank}",
                args=(target, rank, args, result_writer, lifeline_reader),
            )
            process.start()
            result_writer.close()
            lifeline_reader.close()
            processes.append(process)
            result_conns.append(result_reader)
            lifeline_conns.append(lifeline_writer)
    except BaseException:
        WorkerGroup(processes, result_conns, lifeline_conns, first_rank).stop()
        raise
    return WorkerGroup(processes, result_conns, lifeline_conns, first_rank)


def _worker_main(
    target: Callable[..., Any],
    rank: int,
    args: tuple[Any, ...],
    result_conn: Connection,
    lifeline_conn: Connection,
) -> None:
    threading.Thread(
        target=_exit_when_parent_dies, args=(lifeline_conn,), daemon=True, name="tandem-tp-lifeline"
    ).start()
    apply_worker_env()
    try:
        message = ("ok", target(rank, *args))
    except BaseException:  # noqa: BLE001 - everything a rank raises is reported to the parent
        message = ("error", traceback.format_exc())
    try:
        result_conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - an unpicklable result is a failure of the rank too
        result_conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    result_conn.close()
    if message[0] == "error":
        os._exit(1)


def _exit_when_parent_dies(lifeline_conn: Connection) -> None:
    try:
        lifeline_conn.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(_PARENT_GONE_EXIT_CODE)


def _continue(process: BaseProcess) -> None:
    try:
        os.kill(process.pid, signal.SIGCONT)
    except (OSError, TypeError):  # gone already, or never started
        pass


def _describe_exit(process: BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    if code == _PARENT_GONE_EXIT_CODE:
        return "its parent went away"
    return f"exit code {code}"
