"""The engine's CPU thread policy (gpu/cpu_threads.py): usable CPUs from affinity and cgroup
quotas (a fake /proc and /sys tree), the thread counts chosen from them, the overrides, and
an engine loaded on the CPU running with exactly those counts."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu.cpu_threads import (
    MAX_CUDA_HOST_THREADS,
    cgroup_cpu_limit,
    plan_cpu_threads,
    set_quiet_openmp_env,
    thread_override,
    usable_cpus,
)
from tests._command_batch import Command, CommandBatch
from tests._embedded_model import needs_embedded_model

ROOT = Path(__file__).resolve().parents[2]


def _fake_root(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(proc_cgroup)
    for relative, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("proc_cgroup", "files", "limit"),
    [
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        ("0::/\n", {"cpu.max": "250000 100000\n"}, 2),  # 2.5 CPUs round down
        ("0::/\n", {"cpu.max": "50000 100000\n"}, 1),  # half a CPU is still one
        # The tightest of the cgroup and its ancestors.
        (
            "0::/a/b\n",
            {"cpu.max": "max 100000", "a/cpu.max": "300000 100000", "a/b/cpu.max": "max 100000"},
            3,
        ),
        # A host path the container does not see: the mount's own files.
        ("0::/host/only\n", {"cpu.max": "400000 100000"}, 4),
        (
            "4:cpu,cpuacct:/\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            None,
        ),  # fmt: skip
        (
            "4:cpu,cpuacct:/job\n",
            {
                "cpu,cpuacct/job/cpu.cfs_quota_us": "150000",
                "cpu,cpuacct/job/cpu.cfs_period_us": "100000",
            },
            1,
        ),  # fmt: skip
        (
            "1:cpu:/\n2:cpuacct:/\n",
            {"cpu/cpu.cfs_quota_us": "600000", "cpu/cpu.cfs_period_us": "200000"},
            3,
        ),  # fmt: skip
        (
            "4:memory:/x\n",
            {"memory/cpu.cfs_quota_us": "100000", "memory/cpu.cfs_period_us": "100000"},
            None,
        ),  # fmt: skip
        ("0::/\n", {}, None),
    ],
)
def test_cgroup_cpu_limit(
    tmp_path: Path, proc_cgroup: str, files: dict[str, str], limit: int | None
) -> None:
    assert cgroup_cpu_limit(_fake_root(tmp_path, proc_cgroup, files)) == limit


def test_usable_cpus_is_the_affinity_capped_by_the_quota(tmp_path: Path) -> None:
    quota_3 = _fake_root(tmp_path / "q3", "0::/\n", {"cpu.max": "300000 100000"})
    no_quota = _fake_root(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000"})
    assert usable_cpus(quota_3, num_affinity_cpus=8) == 3
    assert usable_cpus(quota_3, num_affinity_cpus=2) == 2
    assert usable_cpus(no_quota, num_affinity_cpus=5) == 5
    assert usable_cpus(tmp_path / "no-proc-at-all", num_affinity_cpus=6) == 6


@pytest.mark.parametrize(
    ("usable", "frontends", "num_ranks", "device_type", "threads"),
    [
        (1, True, 1, "cpu", 1),
        (2, True, 1, "cpu", 1),
        (2, False, 1, "cpu", 1),
        (3, True, 1, "cpu", 2),
        (8, True, 1, "cpu", 7),
        (8, False, 1, "cpu", 8),
        (8, True, 2, "cpu", 3),
        (2, True, 4, "cpu", 1),
        (64, True, 1, "cuda", MAX_CUDA_HOST_THREADS),
        (64, True, 8, "cuda", 7),
        (2, True, 1, "cuda", 1),
    ],
)
def test_plan_leaves_the_front_end_a_cpu_and_splits_between_ranks(
    usable: int, frontends: bool, num_ranks: int, device_type: str, threads: int
) -> None:
    plan = plan_cpu_threads(
        device_type, usable_cpus=usable, frontends_share_host=frontends, num_ranks=num_ranks
    )
    assert (plan.intra_op_threads, plan.inter_op_threads, plan.source) == (threads, 1, "policy")


def test_overrides_the_flag_then_omp_num_threads() -> None:
    assert thread_override(3, {"OMP_NUM_THREADS": "5"}) == (3, "--cpu-threads")
    assert thread_override(None, {"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS")
    for unusable in ("", "0", "two", "-1"):
        assert thread_override(None, {"OMP_NUM_THREADS": unusable}) == (None, "policy")
    plan = plan_cpu_threads(
        "cpu", usable_cpus=2, frontends_share_host=True, override=6, override_source="x"
    )
    assert (plan.intra_op_threads, plan.source) == (6, "x")


def test_quiet_openmp_env_keeps_a_users_choice() -> None:
    environ: dict[str, str] = {}
    set_quiet_openmp_env(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    set_quiet_openmp_env(environ)
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}


_ENGINE_THREADS = """
import json, sys, threading
import torch
from actors.core.engine_startup import load_engine
from actors.protocol.config import EngineConfig
from gpu.cpu_threads import plan_cpu_threads, usable_cpus

cpu_threads = json.loads(sys.argv[1])
frontends = json.loads(sys.argv[2])
initial = torch.get_num_threads()
if cpu_threads == "initial+1":
    cpu_threads = initial + 1
config = EngineConfig(model="default", device="cpu", max_model_len=128, num_kv_blocks=8,
                      cpu_threads=cpu_threads)
load_engine(config, frontends_share_host=frontends)
seen = {}
thread = threading.Thread(target=lambda: seen.update(new_thread=torch.get_num_threads()))
thread.start()
thread.join()
print(json.dumps({
    "initial": initial,
    "expected": cpu_threads or plan_cpu_threads(
        "cpu", usable_cpus=usable_cpus(), frontends_share_host=frontends
    ).intra_op_threads,
    "main_thread": torch.get_num_threads(),
    "new_thread": seen["new_thread"],
    "inter_op": torch.get_num_interop_threads(),
}))
"""


ENGINE_THREAD_CASES = {
    "None-False": (None, False),
    "None-True": (None, True),
    "initial+1-True": ("initial+1", True),
}
"""Case id: (cpu_threads, frontends_share_host)."""


@pytest.fixture(scope="module")
def engine_thread_runs(request: pytest.FixtureRequest) -> Iterator[CommandBatch]:
    """Each case in a fresh process, so that no earlier engine in this one set the counts
    already (the processes run two at a time: tests/_command_batch.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    commands = {
        f"test_an_engine_loaded_on_cpu_runs_the_plans_threads[{case}]": Command(
            (sys.executable, "-c", _ENGINE_THREADS, json.dumps(cpu_threads), json.dumps(frontends)),
            env=env,
            timeout_s=120,
            cwd=ROOT,
        )
        for case, (cpu_threads, frontends) in ENGINE_THREAD_CASES.items()
    }
    with CommandBatch.of_selected(request, commands) as batch:
        yield batch


@pytest.mark.slow
@needs_embedded_model
@pytest.mark.parametrize("case", list(ENGINE_THREAD_CASES))
def test_an_engine_loaded_on_cpu_runs_the_plans_threads(
    case: str, engine_thread_runs: CommandBatch, request: pytest.FixtureRequest
) -> None:
    """Threads started after the load (the GPU actor's) see the same count."""
    result = engine_thread_runs.result(request.node.name)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["main_thread"] == seen["expected"]
    assert seen["new_thread"] == seen["expected"]
    assert seen["inter_op"] == 1
