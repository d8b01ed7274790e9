"""Ranks started by an external launcher (torchrun), as vLLM's `external_launcher` backend.

torchrun starts every rank as the same program, each with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set, and every rank builds the same offline engine
(`LLM(..., distributed_executor_backend="external_launcher")`) and calls the same
`generate`. Here rank 0 runs the engine core exactly as with tandem's own launcher (it
schedules, broadcasts each step, reports tokens), and every other rank repeats its steps
(gpu/distributed/tp_engine.py `StepFollower`). At the end of each `generate`, rank 0
broadcasts its outputs, so every rank returns the same ones. No rank starts or watches a
process: torchrun does both, and ends the job when a rank fails; a rank that hangs fails
the others' collectives after the group's timeout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from actors.protocol.config import ConfigError, EngineConfig
from gpu.distributed.group import (
    DEFAULT_TIMEOUT_S,
    TPGroupSpec,
    init_tp_group,
    set_collective_timeout,
)
from gpu.distributed.step_broadcast import StepBroadcaster
from gpu.distributed.tp_engine import StepFollower
from gpu.distributed.tp_leader import TPLeader
from gpu.platform import Platform
from gpu.worker import ModelWorker

_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class LauncherEnv:
    rank: int
    world_size: int
    local_rank: int


def launcher_env(config: EngineConfig, environ: Any = os.environ) -> LauncherEnv:
    """This process's place among the launched ranks; ConfigError when it was not started
    by a launcher, or the launcher started a number of ranks the config does not ask for."""
    missing = [name for name in _ENV_NAMES if name not in environ]
    if missing:
        raise ConfigError(
            "distributed_executor_backend external_launcher runs under torchrun, which sets "
            f"{', '.join(missing)}; start the program with "
            f"`torchrun --nproc-per-node {config.num_ranks} ...`"
        )
    env = LauncherEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]))
    if env.world_size != config.num_ranks:
        raise ConfigError(
            f"torchrun started {env.world_size} ranks, but tensor_parallel_size "
            f"{config.tensor_parallel_size} x pipeline_parallel_size "
            f"{config.pipeline_parallel_size} needs {config.num_ranks}"
        )
    return env


def load_external_worker(
    config: EngineConfig, platform: Platform, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ModelWorker:
    """This rank's worker, in the group torchrun's ranks form; rank 0's drives the others
    (worker.tp_leader), every other rank's follows it (worker.follower)."""
    env = launcher_env(config)
    device = f"cuda:{env.local_rank}" if platform.device_type == "cuda" else "cpu"
    spec = TPGroupSpec(
        env.rank,
        env.world_size,
        "env://",
        device,
        timeout_s,
        pp_size=config.pipeline_parallel_size,
    )
    group = init_tp_group(spec)
    try:
        worker = ModelWorker(config, platform, tp_group=group)
    except BaseException:
        group.close()
        raise
    # Every rank reads the same config: each sets the serving timeout itself.
    set_collective_timeout(group, config.distributed_timeout_s)
    if env.rank == 0:
        worker.tp_leader = TPLeader(None, group)
    return worker


def follower_of(worker: ModelWorker) -> StepFollower | None:
    """What a rank other than 0 runs in place of an engine (None on rank 0 and without
    an external launcher)."""
    group = worker.tp_group
    if (
        group is None
        or group.rank == 0
        or worker.config.distributed_executor_backend != ("external_launcher")
    ):
        return None
    return StepFollower(worker, StepBroadcaster(group))
