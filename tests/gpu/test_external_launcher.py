"""Ranks started by torchrun (distributed_executor_backend="external_launcher") on CPU.

- Every rank runs the same offline program (tests/gpu/_torchrun_program.py) and returns the
  same outputs, equal to one device's: PP 2 selects the V1 runner (as vLLM 0.29's rule
  does), TP 2 x PP 2 runs on V2 when forced;
- a rank killed mid-job ends the whole job (torchrun's non-zero exit) within bounded time,
  and no rank's process is left behind;
- a program not started by torchrun, or started with a number of ranks the sizes do not
  ask for, is refused in one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from actors.protocol.config import ConfigError, EngineConfig
from app.llm import LLM
from gpu.distributed.external_launcher import launcher_env
from tests._embedded_model import needs_embedded_model
from tests.gpu._parallel_engine import ENGINE_OPTIONS, alive, outputs
from tests.gpu._tiny_checkpoints import save_sharded, tiny_hf_model

PROGRAM = os.path.join(os.path.dirname(__file__), "_torchrun_program.py")
JOB_TIMEOUT_S = 180.0
"""A job takes 5-10 s alone and under 30 s beside two others on two CPUs; a rank still
running after 60 s writes its threads' stacks (tests/gpu/_torchrun_program.py), which a
timed-out job's failure shows."""
KILLED_JOB_ENDS_WITHIN_S = 30.0


def _torchrun(model_dir: str, out_dir: str, tp: int, pp: int, runner: str, *extra: str):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={tp * pp}", PROGRAM, model_dir, out_dir, str(tp), str(pp), runner,
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    # A session of its own: a job that runs out of time is killed with all its ranks.
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    ) as job:  # fmt: skip
        try:
            stdout, stderr = job.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            stderr = job.communicate()[1]
            pytest.fail(f"torchrun job still running after {JOB_TIMEOUT_S} s:\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("qwen3"))
    save_sharded(tiny_hf_model("qwen3"), directory)
    return directory


@pytest.mark.parametrize(
    ("tp", "pp", "runner", "expected_runner"), [(1, 2, "auto", "v1"), (2, 2, "v2", "v2")]
)
def test_every_launched_rank_returns_the_outputs_of_one_device(
    tmp_path, qwen3_dir, tp, pp, runner, expected_runner
) -> None:
    single = outputs(LLM(qwen3_dir, **{**ENGINE_OPTIONS, "dtype": "float32"}))
    job = _torchrun(qwen3_dir, str(tmp_path), tp, pp, runner)
    assert job.returncode == 0, job.stderr[-3000:]
    for rank in range(tp * pp):
        with open(tmp_path / f"rank-{rank}.json") as f:
            record = json.load(f)
        assert record["runner"] == expected_runner
        for one, launched in zip(single, record["outputs"], strict=True):
            assert launched["token_ids"] == list(one.token_ids)
            expected = [e.logprob for e in one.logprobs or ()]
            assert launched["logprobs"] == pytest.approx(expected, abs=1e-4)


def test_a_killed_rank_ends_the_job_and_leaves_no_process(tmp_path, qwen3_dir) -> None:
    started = time.monotonic()
    job = _torchrun(qwen3_dir, str(tmp_path), 1, 2, "auto", "1")
    assert job.returncode != 0
    assert time.monotonic() - started < KILLED_JOB_ENDS_WITHIN_S
    pids = [int((tmp_path / f"pid-{rank}").read_text()) for rank in range(2)]
    assert alive(pids) == []
    assert not (tmp_path / "rank-0.json").exists()


def test_a_program_not_started_by_torchrun_is_refused() -> None:
    config = EngineConfig(
        pipeline_parallel_size=2, distributed_executor_backend="external_launcher"
    )
    with pytest.raises(ConfigError, match="runs under torchrun, which sets RANK, WORLD_SIZE"):
        launcher_env(config, environ={})
    env = {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
    }
    with pytest.raises(ConfigError, match="torchrun started 4 ranks, but .* needs 2"):
        launcher_env(config, environ=env)
    assert launcher_env(config, environ={**env, "WORLD_SIZE": "2", "RANK": "1"}).rank == 1


@pytest.mark.slow
@needs_embedded_model
def test_tandem_generate_under_torchrun_prints_once_what_one_process_prints() -> None:
    args = ["generate", "--model", "default", "--quantization", "none", "--device", "cpu",
            "--prompt", "The capital of France is", "--max-tokens", "6", "--json",
            "--no-progress", "--max-model-len", "256"]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "app.cli", *args, "-pp", "2", "--distributed-executor-backend",
         "external_launcher"],
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env, check=False,
    )  # fmt: skip
    single = subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env, check=True,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    [record] = [json.loads(line) for line in launched.stdout.splitlines()]
    [expected] = [json.loads(line) for line in single.stdout.splitlines()]
    assert record["token_ids"] == expected["token_ids"] and record["runner"] == "v1"
