"""How many CPU threads the engine's torch uses: chosen from the CPUs this process may run
on, so that its OpenMP team never outnumbers them.

An OpenMP team larger than the CPUs it gets collapses when other processes share them:
every parallel region ends in a barrier that waits for a descheduled thread (a 32-token
completion took 29 s instead of 2 s on a shared 2-core host). So:

- usable CPUs: the process's CPU affinity, capped by its cgroup CPU quota (v2 `cpu.max`,
  v1 `cpu.cfs_quota_us / cpu.cfs_period_us`) rounded down; never `os.cpu_count()`.
- intra-op threads: 1 on 1-2 usable CPUs; above that, all of them, less one for the API
  servers when they run beside the engine core; split between tensor-parallel ranks and
  the engine cores of `--data-parallel-size`; at most MAX_CUDA_HOST_THREADS on CUDA, where
  the engine's host work is small.
- inter-op threads: 1 (the engine runs no inter-op parallel work).
- `--cpu-threads N` (EngineConfig.cpu_threads), else OMP_NUM_THREADS, overrides the count.
- OMP_WAIT_POLICY=PASSIVE, unless set already, so that idle OpenMP threads sleep instead of
  spinning for milliseconds after every parallel region. torch's OpenMP (libgomp) reads it
  once, when torch is imported: `set_quiet_openmp_env` must run before that.

This module imports torch only inside `apply_cpu_threads` and `log_cpu_threads`.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from actors.protocol.config import EngineConfig

log = structlog.get_logger("tandem.cpu_threads")

MAX_CUDA_HOST_THREADS = 8
"""Most intra-op threads on CUDA, where torch's CPU work is input staging and small ops."""
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
THREADS_ENV = "OMP_NUM_THREADS"
_CGROUP_V1_CPU_DIRS = ("cpu,cpuacct", "cpuacct,cpu", "cpu")


@dataclass(frozen=True, slots=True)
class CPUThreadPlan:
    usable_cpus: int
    """CPUs this process may run on (affinity capped by the cgroup quota)."""
    intra_op_threads: int
    inter_op_threads: int
    source: str
    """'--cpu-threads', 'OMP_NUM_THREADS' or 'policy'."""


def plan_cpu_threads(
    device_type: str,
    *,
    usable_cpus: int,
    frontends_share_host: bool,
    num_ranks: int = 1,
    override: int | None = None,
    override_source: str = "--cpu-threads",
) -> CPUThreadPlan:
    """The thread counts of one engine process (one rank of `num_ranks`).

    `frontends_share_host`: API-server processes run beside this one (`tandem serve`),
    rather than the front end sharing this process (the offline LLM)."""
    if override is not None:
        return CPUThreadPlan(usable_cpus, override, 1, override_source)
    if usable_cpus <= 2:
        budget = 1
    else:
        budget = usable_cpus - 1 if frontends_share_host else usable_cpus
    threads = max(1, budget // num_ranks)
    if device_type == "cuda":
        threads = min(threads, MAX_CUDA_HOST_THREADS)
    return CPUThreadPlan(usable_cpus, threads, 1, "policy")


def engine_thread_plan(
    config: EngineConfig, device_type: str, frontends_share_host: bool
) -> CPUThreadPlan:
    """The plan of one engine process (or tensor-parallel rank) serving `config`."""
    override, source = thread_override(config.cpu_threads)
    return plan_cpu_threads(
        device_type,
        usable_cpus=usable_cpus(),
        frontends_share_host=frontends_share_host,
        num_ranks=config.num_ranks * config.data_parallel_size,
        override=override,
        override_source=source,
    )


def thread_override(
    cpu_threads: int | None, environ: MutableMapping[str, str] = os.environ
) -> tuple[int | None, str]:
    """(threads, where they came from): EngineConfig.cpu_threads, else a positive integer
    in OMP_NUM_THREADS, else (None, 'policy')."""
    if cpu_threads is not None:
        return cpu_threads, "--cpu-threads"
    value = environ.get(THREADS_ENV, "").strip()
    if value.isdigit() and int(value) >= 1:
        return int(value), THREADS_ENV
    return None, "policy"


def usable_cpus(root: Path = Path("/"), num_affinity_cpus: int | None = None) -> int:
    """CPUs this process may use: its affinity mask capped by its cgroup CPU quota.
    `root` is where /proc and /sys are found (tests pass a fake tree)."""
    if num_affinity_cpus is None:
        num_affinity_cpus = _num_affinity_cpus()
    limit = cgroup_cpu_limit(root)
    return max(1, num_affinity_cpus if limit is None else min(num_affinity_cpus, limit))


def cgroup_cpu_limit(root: Path = Path("/")) -> int | None:
    """The tightest CPU quota of this process's cgroup and its ancestors, in whole CPUs
    (rounded down, at least 1), or None without a quota."""
    limits = [
        limit
        for controllers, path in _own_cgroups(root)
        for limit in _cgroup_limits(root / "sys/fs/cgroup", controllers, path)
    ]
    return max(1, min(limits)) if limits else None


def set_quiet_openmp_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Let idle OpenMP threads sleep at once (OMP_WAIT_POLICY=PASSIVE) unless the user
    chose a policy. Takes effect only in a process that has not imported torch yet, and in
    its children."""
    environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def apply_cpu_threads(plan: CPUThreadPlan) -> None:
    """Set torch's thread counts to `plan`. Threads started afterwards (the GPU actor's)
    take the intra-op count when they first run a torch op. The inter-op count can be set
    once per process, before any inter-op work: a later call keeps it."""
    import torch

    torch.set_num_threads(plan.intra_op_threads)
    try:
        torch.set_num_interop_threads(plan.inter_op_threads)
    except RuntimeError:
        pass  # set already in this process (a second engine, or the caller did)


def log_cpu_threads(plan: CPUThreadPlan) -> None:
    """One `cpu_threads` log line with the counts in effect (once the model has loaded, so
    that a start that fails says only why)."""
    import torch

    log.info(
        "cpu_threads",
        usable_cpus=plan.usable_cpus,
        intra_op_threads=torch.get_num_threads(),
        inter_op_threads=torch.get_num_interop_threads(),
        source=plan.source,
        omp_wait_policy=os.environ.get(WAIT_POLICY_ENV),
    )


def _num_affinity_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _own_cgroups(root: Path) -> list[tuple[str, str]]:
    """(controllers, path) for each line of /proc/self/cgroup; controllers is '' for v2."""
    try:
        text = (root / "proc/self/cgroup").read_text()
    except OSError:
        return []
    entries = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            entries.append((parts[1], parts[2]))
    return entries


def _cgroup_limits(mount: Path, controllers: str, path: str) -> list[int]:
    if controllers == "":
        return [
            limit
            for folder in _folders_up(mount, path)
            if (limit := _v2_limit(folder / "cpu.max")) is not None
        ]
    if "cpu" not in controllers.split(","):
        return []
    return [
        limit
        for name in _CGROUP_V1_CPU_DIRS
        for folder in _folders_up(mount / name, path)
        if (limit := _v1_limit(folder)) is not None
    ]


def _folders_up(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder and its ancestors up to the mount. In a container the path can
    name a host folder that the container does not see: then only the mount's own."""
    folder = mount / path.strip("/")
    folders = []
    while True:
        folders.append(folder)
        if folder == mount or mount not in folder.parents:
            return folders
        folder = folder.parent


def _v2_limit(cpu_max: Path) -> int | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return _whole_cpus(quota, period)


def _v1_limit(folder: Path) -> int | None:
    try:
        quota = (folder / "cpu.cfs_quota_us").read_text().strip()
        period = (folder / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _whole_cpus(quota, period)


def _whole_cpus(quota: str, period: str) -> int | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:  # -1: no quota (v1)
        return None
    return max(1, quota_us // period_us)
