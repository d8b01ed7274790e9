"""One engine over N devices (TP x PP ranks): rank 0's worker and runner, and the other
ranks' loop.

`load_tp_worker` (engine startup) spawns ranks 1..N-1, joins the group as rank 0 in the
calling process and loads rank 0's shard; every rank sizes the same KV cache (the least
any rank can hold) and captures its own CUDA graphs. `ParallelRunner` is the runner the
engine core drives: it hands each step to the other ranks (gpu/distributed/tp_leader.py),
then runs it on rank 0. Every rank runs the same runner (V2, or the V1 fallback) on the
same scheduler output: the same request rows, the same input preparation on its own
device, the same collectives, after which every rank holds the step's tokens (V2 samples
the batch sharded over a stage's ranks, V1 samples the gathered logits on each; under
pipeline parallelism the last stage samples and shares them: gpu/distributed/pipeline.py).
Rank 0's runner alone reports them to the scheduler.

A failed step on any rank fails the group (the ranks would no longer agree on the rows
or the collectives), so the engine is declared dead rather than left waiting.
"""

from __future__ import annotations

import collections
import os
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any, TypeVar

import msgspec
import structlog
import torch

from actors.protocol.codec import dec_hook, ext_hook
from actors.protocol.config import EngineConfig
from actors.protocol.messages import SchedulerOutput
from gpu.cpu_threads import apply_cpu_threads, engine_thread_plan
from gpu.distributed.group import (
    DEFAULT_TIMEOUT_S,
    TPGroupSpec,
    init_tp_group,
    set_collective_timeout,
    tcp_rendezvous,
)
from gpu.distributed.launch import RankFailedError, WorkerGroup, start_workers
from gpu.distributed.step_broadcast import StepBroadcaster
from gpu.distributed.tp_leader import (
    CLOSE,
    OPEN,
    RESULT,
    STEP,
    TIMEOUT,
    TPFailedError,
    TPLeader,
)
from gpu.platform import Platform, probe_platform
from gpu.runner import LaunchedStep, Runner
from gpu.runner_v1.runner import ModelRunnerV1
from gpu.runner_v2.runner import ModelRunnerV2
from gpu.worker import ModelWorker

log = structlog.get_logger("tandem.tp")

T = TypeVar("T")
STARTUP_POLL_S = 0.2
RANK0_SAME_FAILURE_WAIT_S = 2.0
MAX_PENDING_STEPS = 2
"""Steps a worker rank keeps in flight before it waits for the oldest (as rank 0's
GPU actor does), so that its device queue stays bounded."""


def rank_device(platform: Platform, rank: int) -> str:
    """Rank r runs on cuda:r (validated: one visible GPU per rank), or on the CPU."""
    return f"cuda:{rank}" if platform.device_type == "cuda" else "cpu"


def load_tp_worker(
    config: EngineConfig,
    platform: Platform,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    step_timeout_s: float | None = None,
) -> ModelWorker:
    """Rank 0's ModelWorker, with the other ranks started and loaded: worker.tp_leader
    drives them. Raises RankFailedError (with the failing rank's error) when a rank fails
    to start or load. A collective fails (and with it the engine) after `timeout_s` while
    the ranks start, after `step_timeout_s` (default: --distributed-timeout-seconds) once
    they serve."""
    init_method = tcp_rendezvous()
    # The other ranks run as many torch threads as rank 0 (chosen at engine startup).
    rank_config = config.replace(cpu_threads=torch.get_num_threads())
    workers = start_workers(
        worker_rank_main, config.num_ranks, (rank_config, init_method, timeout_s), first_rank=1
    )
    try:
        worker = _while_ranks_live(
            workers, lambda: _rank0_worker(config, platform, init_method, timeout_s)
        )
    except BaseException:
        workers.stop()
        raise
    worker.tp_leader = TPLeader(workers, worker.tp_group)
    worker.tp_leader.set_step_timeout(
        config.distributed_timeout_s if step_timeout_s is None else step_timeout_s
    )
    log.info(
        "tensor_parallel_ready",
        tp_size=config.tensor_parallel_size,
        pp_size=config.pipeline_parallel_size,
        worker_pids=workers.pids,
        device=str(worker.device),
    )
    return worker


def _rank0_worker(
    config: EngineConfig, platform: Platform, init_method: str, timeout_s: float
) -> ModelWorker:
    spec = _group_spec(config, 0, init_method, rank_device(platform, 0), timeout_s)
    group = init_tp_group(spec)
    try:
        return ModelWorker(config, platform, tp_group=group)
    except BaseException:
        group.close()
        raise


def _group_spec(
    config: EngineConfig, rank: int, init_method: str, device: str, timeout_s: float
) -> TPGroupSpec:
    return TPGroupSpec(
        rank,
        config.num_ranks,
        init_method,
        device,
        timeout_s,
        pp_size=config.pipeline_parallel_size,
    )


def _while_ranks_live(workers: WorkerGroup, load: Callable[[], T]) -> T:
    """`load()` (rank 0's part of the startup), in a thread, while watching the other
    ranks: a rank that fails makes this raise at once with its error instead of leaving
    rank 0 waiting for it in a collective."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = load()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="tandem-tp-rank0-load", daemon=True)
    thread.start()
    sentinels = [process.sentinel for process in workers.processes]
    while thread.is_alive():
        if wait(sentinels, timeout=STARTUP_POLL_S):
            # Every rank loads the same model: rank 0 usually fails the same way, and its
            # error (a configuration error, say) is the one to report.
            thread.join(RANK0_SAME_FAILURE_WAIT_S)
            if "error" not in outcome:
                workers.wait(timeout_s=5.0)  # raises RankFailedError naming the rank
                raise RankFailedError({workers.first_rank: "exited during startup"})
        thread.join(STARTUP_POLL_S)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


RUNNERS: dict[str, type[ModelRunnerV1] | type[ModelRunnerV2]] = {
    "v1": ModelRunnerV1,
    "v2": ModelRunnerV2,
}


class ParallelRunner:
    """The runner of a multi-rank engine, on rank 0 (see the module doc): `runner` ('v2' or
    'v1') names the runner every rank runs."""

    def __init__(
        self, worker: ModelWorker, config: EngineConfig | None = None, runner: str = "v2"
    ) -> None:
        self.leader: TPLeader = worker.tp_leader
        self.inner: Runner = RUNNERS[runner](worker, config)
        self.name = self.inner.name
        self.max_steps_in_flight = self.inner.max_steps_in_flight
        eager = getattr(self.inner, "graphs", None) is None
        try:
            self.leader.open_runner(runner, config or worker.config, eager=eager)
        except BaseException:
            self.inner.close()
            raise
        self.deferred_masks = self.inner.deferred_masks

    @property
    def num_free_rows(self) -> int:
        return self.inner.num_free_rows

    def execute(self, sched: SchedulerOutput) -> LaunchedStep:
        if sched.grammar_bitmask is not None or sched.grammar_mask_deferred:
            # The sharded sampler applies no mask, and a deferred one reaches rank 0 only.
            raise ValueError("structured outputs are not available with tensor parallelism")
        self.leader.send_step(sched)
        try:
            return self.inner.execute(sched)
        except Exception as exc:
            self.leader.step_failed(exc)
            raise

    def close(self) -> None:
        self.inner.close()
        self.leader.close_runner()


def worker_rank_main(rank: int, config: EngineConfig, init_method: str, timeout_s: float) -> None:
    """A spawned rank: join the group, load the shard, run what rank 0 sends until it
    shuts the loop down."""
    platform = probe_platform(config.device)
    # N ranks share the host's cores: each taking all of them would oversubscribe them,
    # and every collective would wait for a descheduled peer.
    apply_cpu_threads(engine_thread_plan(config, platform.device_type, True))
    spec = _group_spec(config, rank, init_method, rank_device(platform, rank), timeout_s)
    group = init_tp_group(spec)
    try:
        worker = ModelWorker(config, platform, tp_group=group)
        follow_steps(worker, StepBroadcaster(group))
    finally:
        group.close()


def follow_steps(worker: ModelWorker, broadcaster: StepBroadcaster) -> None:
    """Repeat rank 0's runner until rank 0 shuts the loop down."""
    StepFollower(worker, broadcaster).follow()
    log.info("tensor_parallel_rank_done", pid=os.getpid())


class StepFollower:
    """A rank other than 0 repeating rank 0's runner: OPEN builds one, STEP runs a step,
    CLOSE closes it, TIMEOUT sets the collectives' timeout."""

    def __init__(self, worker: ModelWorker, broadcaster: StepBroadcaster) -> None:
        self.worker = worker
        self.broadcaster = broadcaster
        self._decoder = msgspec.msgpack.Decoder(
            SchedulerOutput, ext_hook=ext_hook, dec_hook=dec_hook
        )
        self._runner: Any = None
        self._pending: collections.deque[Any] = collections.deque()
        self.shut_down = False
        """Rank 0 has shut the loop down."""

    def follow(self) -> Any:
        """Run rank 0's messages until it sends a RESULT (returned: a generate call's
        outputs) or shuts the loop down (returns None)."""
        while (message := self.broadcaster.recv()) is not None:
            kind, body = message[:1], memoryview(message)[1:]
            if kind == RESULT:
                return pickle.loads(body)
            self._handle(kind, body)
        self.shut_down = True
        return None

    def _handle(self, kind: bytes, body: memoryview) -> None:
        if kind == STEP:
            self._pending.append(self._runner.execute(self._decoder.decode(body)))
            if len(self._pending) > max(MAX_PENDING_STEPS, self._runner.max_steps_in_flight):
                self._pending.popleft().result()
        elif kind == OPEN:
            name, config, eager = pickle.loads(body)
            config = config.replace(enforce_eager=True) if eager else config
            self._runner = RUNNERS[name](self.worker, config)
            if not eager and getattr(self._runner, "graphs", None) is None:  # padding differs
                raise TPFailedError("rank 0 runs CUDA graphs but this rank has none")
        elif kind == TIMEOUT:
            set_collective_timeout(self.broadcaster.group, float(bytes(body).decode()))
        elif kind == CLOSE:
            while self._pending:
                self._pending.popleft().result()
            self._runner.close()
            self._runner = None
        else:
            raise TPFailedError(f"unknown message from rank 0: {kind!r}")
