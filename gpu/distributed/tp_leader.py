"""Rank 0's side of a tensor-parallel engine: it drives ranks 1..N-1 and watches them.

Rank 0 lives in the engine-core process next to the scheduler; each other rank is a
spawned worker process (gpu/distributed/tp_engine.py) that loads its shard and then
repeats what rank 0 tells it, over the step broadcast (gpu/distributed/step_broadcast.py):

    OPEN  (runner, config, eager)  build a runner, V2 or V1 (an engine started on the model)
    STEP  (SchedulerOutput)        run one step: the same rows, inputs and collectives
    CLOSE                          close the runner (the engine stopped)
    TIMEOUT (seconds)              collectives fail after this long from now on
    RESULT (outputs)               a generate call's outputs (ranks of an external launcher
                                   return them from their own generate)
    shutdown                       leave the loop, tear the group down, exit

A step is serialised once (msgpack) and reaches every rank in one broadcast. A monitor
thread waits on the worker processes: when one exits while the engine runs, rank 0 is
marked failed (its reason names the rank and what it raised), the other workers are
stopped, and the failure callback (the engine's dead path) runs. Every later OPEN or STEP
raises at once, so no caller waits on a collective that cannot complete.
"""

from __future__ import annotations

import atexit
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import msgspec
import structlog
import torch.distributed as dist

from actors.protocol.codec import enc_hook
from gpu.distributed.group import TPGroup, set_collective_timeout
from gpu.distributed.launch import RankFailedError, WorkerGroup
from gpu.distributed.step_broadcast import StepBroadcaster

log = structlog.get_logger("tandem.tp")

OPEN, STEP, CLOSE, TIMEOUT, RESULT = b"O", b"S", b"C", b"T", b"R"
SHUTDOWN_TIMEOUT_S = 30.0
FAILURE_DETAILS_TIMEOUT_S = 3.0
"""How long the failing rank has to report its error once its process is gone."""
PEER_EXIT_WAIT_S = 1.0
"""How long a failed step on rank 0 waits to see whether another rank has exited (the
usual cause: the collective saw its connection drop as the process died)."""


class TPFailedError(RuntimeError):
    """A tensor-parallel rank failed: the engine cannot run another step."""


class TPLeader:
    def __init__(self, workers: WorkerGroup | None, group: TPGroup) -> None:
        self.workers = workers
        """The spawned ranks' processes; None when an external launcher (torchrun) started
        them: it watches them itself."""
        self.group = group
        self.failure: str | None = None
        """Why the group failed (set once); None while every rank runs."""
        self._broadcaster = StepBroadcaster(group)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
        self._step_buffer = bytearray(STEP)
        self._send_lock = threading.Lock()
        """Held while a message goes out (one sender at a time)."""
        self._state_lock = threading.Lock()
        """Guards failure and _closing; never held across a collective."""
        self._exit_lock = threading.Lock()
        self._on_failure: Callable[[str], None] | None = None
        self._runner_open = False
        self._closing = False
        if workers is not None:
            monitor = threading.Thread(target=self._watch, name="tandem-tp-monitor", daemon=True)
            monitor.start()
        # An engine left open at exit still shuts its ranks down in order (a killed
        # process's ranks exit on their own: launch.py's lifeline).
        atexit.register(self.close)

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def on_failure(self, callback: Callable[[str], None] | None) -> None:
        """Call `callback(reason)` (from the monitor thread) when a rank fails; at once if
        one already has. One callback at a time: the engine now running on the model."""
        self._on_failure = callback
        if callback is not None and self.failure is not None:
            callback(self.failure)

    def open_runner(self, runner: str, config: Any, eager: bool) -> None:
        """Have every other rank build runner `runner` ('v2' or 'v1') with `config` (eager:
        without graphs, as rank 0's runner, so that every rank launches the same
        collectives)."""
        with self._send_lock:
            self._check_healthy()
            if self._runner_open:
                raise TPFailedError("a tensor-parallel model serves one engine at a time")
            self._broadcaster.send(OPEN + pickle.dumps((runner, config, eager)))
            self._runner_open = True

    def set_step_timeout(self, timeout_s: float) -> None:
        """Every rank's collectives fail after `timeout_s` from now on (a hung rank)."""
        with self._send_lock:
            self._check_healthy()
            self._broadcaster.send(TIMEOUT + repr(float(timeout_s)).encode())
            set_collective_timeout(self.group, timeout_s)

    def send_step(self, sched: Any) -> None:
        with self._send_lock:
            self._check_healthy()
            self._encoder.encode_into(sched, self._step_buffer, 1)
            self._broadcaster.send(self._step_buffer)

    def send_result(self, outputs: Any) -> None:
        """Hand a generate call's outputs to every other rank (external launcher)."""
        with self._send_lock:
            self._check_healthy()
            self._broadcaster.send(RESULT + pickle.dumps(outputs))

    def close_runner(self) -> None:
        with self._send_lock:
            if self._runner_open and self.failure is None and not self._closing:
                self._broadcaster.send(CLOSE)
            self._runner_open = False

    def fail(self, reason: str) -> None:
        """Mark the group failed: stop every worker, unblock rank 0's collectives, tell
        the engine. Only the first reason counts."""
        with self._state_lock:
            if self.failure is not None or self._closing:
                return
            self.failure = reason
        log.error("tensor_parallel_failed", reason=reason)
        if self.workers is not None:
            self.workers.stop()
        _abort_collectives()
        callback = self._on_failure
        if callback is not None:
            try:
                callback(reason)
            except RuntimeError:  # the engine's event loop has closed: nobody to tell
                pass

    def close(self) -> None:
        """Shut every other rank down (they leave their loops and exit), then leave the
        group. Safe to call more than once, and after a failure."""
        with self._state_lock:
            if self._closing:
                return
            self._closing = True
            healthy = self.failure is None
        atexit.unregister(self.close)
        if healthy:
            try:
                with self._send_lock:
                    self._broadcaster.send_shutdown()
                if self.workers is not None:
                    self.workers.wait(SHUTDOWN_TIMEOUT_S)
            except (RuntimeError, OSError) as exc:  # a rank failed on the way out
                log.warning("tensor_parallel_shutdown", error=str(exc))
        if self.workers is not None:
            self.workers.stop()
        self.group.close()

    def _check_healthy(self) -> None:
        if self.failure is not None:
            raise TPFailedError(self.failure)
        if self._closing:
            raise TPFailedError("the tensor-parallel workers have been shut down")

    def step_failed(self, exc: BaseException) -> None:
        """Rank 0's step raised: the group has failed. When another rank has exited, that
        is the cause (rank 0's collective only lost its peer), and the failure names it."""
        if self.workers is not None and wait(self._sentinels(), timeout=PEER_EXIT_WAIT_S):
            self._fail_from_exit()
        else:
            self.fail(f"tensor-parallel rank 0 failed a step: {type(exc).__name__}: {exc}")

    def _watch(self) -> None:
        wait(self._sentinels())
        self._fail_from_exit()

    def _fail_from_exit(self) -> None:
        with self._exit_lock:  # the monitor and a failed step may both get here
            with self._state_lock:
                if self._closing or self.failure is not None:
                    return
            try:
                if self.workers is not None:
                    self.workers.wait(FAILURE_DETAILS_TIMEOUT_S)
                reason = "a tensor-parallel worker exited while the engine ran"
            except RankFailedError as exc:
                reason = str(exc)
            self.fail(reason)

    def _sentinels(self) -> list[int]:
        return [] if self.workers is None else [p.sentinel for p in self.workers.processes]


def _abort_collectives() -> None:
    """Make rank 0's pending and future device collectives fail instead of waiting for a
    rank that is gone (NCCL waits for ever; gloo notices the closed connection itself)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    try:
        abort()
    except Exception as exc:  # noqa: BLE001 - best effort: the engine is dead either way
        log.warning("tensor_parallel_abort_failed", error=repr(exc))
