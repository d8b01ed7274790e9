"""`--data-parallel-size` / `-dp` as a user meets it: help that says what it does, one-line
errors (exit 2) for what does not work yet, where each core runs, and a start that one core
refuses leaving nothing behind."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.protocol.config import ConfigError, EngineConfig
from gpu.distributed.dp_placement import place_data_parallel_rank
from tests._command_batch import Command, CommandBatch, cli
from tests._embedded_model import needs_embedded_model

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = "tests.gpu._sample_logits_processor:ForceOrBanTokens"
NOT_YET = {
    "dp-0": (("-dp", "0"), "--data-parallel-size must be in [1, 64]"),
    "dp-65": (("-dp", "65"), "--data-parallel-size must be in [1, 64]"),
    "with-tp": (
        ("-dp", "2", "-tp", "2"),
        "with --tensor-parallel-size or --pipeline-parallel-size above 1 is not supported yet",
    ),
    "one-gpu": (("-dp", "2", "--device", "cuda:1"), "--device cuda:1 names one GPU"),
}
"""Case id: (serve's flags, what its error line says)."""


def _serve(*args: str, env: dict[str, str] | None = None) -> Command:
    return cli("serve", "--port", "0", *args, env=env or {}, timeout_s=120, cwd=ROOT)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp_cli")


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp: Path) -> Iterator[CommandBatch]:
    """The module's `tandem serve` runs, two at a time (tests/_command_batch.py)."""
    commands = {
        "test_a_core_that_refuses_to_start_stops_the_others_and_leaves_nothing": _serve(
            *("--device", "cpu", "--log-format", "console", "-dp", "2", "--runner", "v2"),
            *("--logits-processors", SAMPLE),
            env={"TMPDIR": str(tmp)},
        ),
        "test_help_says_what_the_flag_does": cli("serve", "--help", timeout_s=60, cwd=ROOT),
    }
    for case, (args, _) in NOT_YET.items():
        name = f"test_combinations_that_do_not_work_yet_are_refused_on_one_line[{case}]"
        commands[name] = _serve(*args)
    with CommandBatch.of_selected(request, commands) as batch:
        yield batch


@pytest.fixture
def result(runs: CommandBatch, request: pytest.FixtureRequest) -> subprocess.CompletedProcess[str]:
    """The run of the requesting test's command."""
    return runs.result(request.node.name)


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("tandem: error: ")
    return last


def test_help_says_what_the_flag_does(result: subprocess.CompletedProcess[str]) -> None:
    text = " ".join(result.stdout.split())
    for fragment in (
        "--data-parallel-size DATA_PARALLEL_SIZE, -dp DATA_PARALLEL_SIZE",
        "core i on cuda:i",
        "least loaded core",
        "are per core",
        'engine="i"',
        "Not with --tensor-parallel-size or --pipeline-parallel-size above 1 yet",
    ):
        assert fragment in text, fragment


@pytest.mark.parametrize("case", list(NOT_YET))
def test_combinations_that_do_not_work_yet_are_refused_on_one_line(
    case: str, result: subprocess.CompletedProcess[str]
) -> None:
    assert NOT_YET[case][1] in _one_line_error(result)


def test_core_i_runs_on_cuda_i_and_every_core_on_the_cpu() -> None:
    def placed(device: str, rank: int, visible: int) -> str:
        config = EngineConfig(device=device, data_parallel_size=2, data_parallel_rank=rank)
        return place_data_parallel_rank(config, num_visible_devices=visible).device

    assert [placed("cuda", rank, 8) for rank in (0, 1)] == ["cuda:0", "cuda:1"]
    assert placed("auto", 1, 2) == "cuda:1"
    assert placed("auto", 1, 0) == "cpu" and placed("cpu", 1, 8) == "cpu"
    with pytest.raises(ConfigError, match="needs 2 GPUs, but 1 is visible"):
        placed("cuda", 0, 1)
    one = EngineConfig(device="cuda:3")
    assert place_data_parallel_rank(one, num_visible_devices=8) is one
    with pytest.raises(ConfigError, match="data_parallel_rank must be in"):
        EngineConfig(data_parallel_size=2, data_parallel_rank=2)


@pytest.mark.slow
@needs_embedded_model
def test_a_core_that_refuses_to_start_stops_the_others_and_leaves_nothing(
    result: subprocess.CompletedProcess[str], tmp: Path
) -> None:
    """Both cores refuse these flags before loading the model; the server says why on one
    line, exits 2, and neither a core nor an ipc folder is left."""
    assert "does not support custom logits processors" in _one_line_error(result)
    assert not list(tmp.glob("tandem-*"))
