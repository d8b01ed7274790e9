"""The flags behind runner-selection rule 5, as a user meets them on the command line:
help that says what exists and what does not, and one-line startup errors (exit 2) for
what cannot be served, before any model is loaded."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests._command_batch import Command, cli
from tests._embedded_model import needs_embedded_model

SAMPLE = "tests.gpu._sample_logits_processor:ForceOrBanTokens"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
BAD_SERVE_FLAGS = {
    "processor-form": (
        ("--logits-processors", "missing_colon"),
        ("must have the form module:Class",),
    ),
    "spec-json": (("--speculative-config", '{"method": "ngram"'), ("not valid JSON",)),
    "spec-value": (
        ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'),
        ("num_speculative_tokens must be an integer >= 1",),
    ),
}
"""Case id: (serve's extra flags, what its error line says)."""
REFUSED_BEFORE_LOADING = {
    "forced-v2-processors": (
        ("--runner", "v2", "--logits-processors", SAMPLE),
        {},
        ("forces the V2 runner", "does not support custom logits processors", SAMPLE),
    ),
    "forced-v2-compile-env": (
        ("-O1",),
        {"TANDEM_USE_V2_MODEL_RUNNER": "1"},
        ("TANDEM_USE_V2_MODEL_RUNNER forces the V2 runner", "stock torch.compile"),
    ),
    "forced-v2-compile-flag": (
        ("--runner", "v2", "--compile-level", "2"),
        {},
        ("--runner v2 forces the V2 runner", "stock torch.compile"),
    ),
    "processor-import": (
        ("--logits-processors", "no_such_module:Proc"),
        {},
        ("cannot import module 'no_such_module'",),
    ),
}
"""Case id: (generate's extra flags, environment, what its error line says)."""
SPECULATING = {"v2": ((), "v2"), "v1-with-processors": (("--logits-processors", SAMPLE), "v1")}
"""Case id: (generate's extra flags, the runner they choose)."""


def _commands(tmp: Path) -> dict[str, Command]:
    """Each test's command, under its name, the longest first (`tmp`: the TMPDIR of the
    serve that refuses)."""
    paris = ("generate", "--prompt", "What is the capital of France?", "--max-tokens", "8")
    paris += ("--temperature", "0", "--json")
    commands = {
        "test_generate_runs_a_logits_processor_on_v1": cli(*paris, "--logits-processors", SAMPLE)
    }
    for case, (extra, _) in SPECULATING.items():
        commands[f"test_generate_speculates_on_the_runner_the_other_flags_choose[{case}]"] = cli(
            *paris, "--speculative-config", NGRAM, *extra
        )
    commands["test_serve_stops_when_its_engine_refuses"] = cli(
        *("serve", "--port", "0", "--device", "cpu", "--log-format", "console"),
        *("--runner", "v2", "--logits-processors", SAMPLE),
        env={"TMPDIR": str(tmp)},
        timeout_s=120,
    )
    for case, (args, env, _) in REFUSED_BEFORE_LOADING.items():
        commands[f"test_the_engine_refuses_before_loading_the_model[{case}]"] = cli(
            "generate", "--prompt", "hi", "--device", "cpu", *args, env=env, timeout_s=120
        )
    for case, (args, _) in BAD_SERVE_FLAGS.items():
        commands[f"test_serve_refuses_bad_flags_in_one_line[{case}]"] = cli(
            "serve", "--port", "0", "--device", "cpu", *args, timeout_s=120
        )
    commands["test_serve_help_documents_the_runner_and_parallelism_flags"] = cli(
        "serve", "--help", timeout_s=120
    )
    return commands


def _last_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("tandem: error: ")
    return last


def test_serve_help_documents_the_runner_and_parallelism_flags(
    result: subprocess.CompletedProcess[str],
) -> None:
    text = " ".join(result.stdout.split())
    for fragment in (
        "-O {0,1,2}, --compile-level {0,1,2}",
        "--logits-processors",
        "--speculative-config",
        "vllm_xargs",
        "--enable-sequence-parallelism",
        "--pipeline-parallel-size PIPELINE_PARALLEL_SIZE, -pp PIPELINE_PARALLEL_SIZE",
        "--distributed-executor-backend {mp,external_launcher}",
        "--distributed-timeout-seconds",
    ):
        assert fragment in text


@pytest.mark.parametrize("case", list(BAD_SERVE_FLAGS))
def test_serve_refuses_bad_flags_in_one_line(
    case: str, result: subprocess.CompletedProcess[str]
) -> None:
    line = _last_error_line(result)
    for fragment in BAD_SERVE_FLAGS[case][1]:
        assert fragment in line


@pytest.mark.parametrize("case", list(REFUSED_BEFORE_LOADING))
def test_the_engine_refuses_before_loading_the_model(
    case: str, result: subprocess.CompletedProcess[str]
) -> None:
    line = _last_error_line(result)
    for fragment in REFUSED_BEFORE_LOADING[case][2]:
        assert fragment in line
    assert "model_loaded" not in result.stderr


@needs_embedded_model  # `serve` resolves the model before its engine refuses
def test_serve_stops_when_its_engine_refuses(
    result: subprocess.CompletedProcess[str], tmp: Path
) -> None:
    assert result.returncode != 0
    assert "does not support custom logits processors" in result.stderr
    assert "model_loaded" not in result.stderr
    assert not list(tmp.glob("tandem-*")), "the engine's ipc folder was left behind"


@pytest.mark.slow
@needs_embedded_model
def test_generate_runs_a_logits_processor_on_v1(result: subprocess.CompletedProcess[str]) -> None:
    # ForceOrBanTokens only acts on requests with vllm_xargs; `generate` sends none, so the
    # answer is the plain one, on the runner rule 5 chose.
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.splitlines()[0])
    assert record["runner"] == "v1" and "custom logits processors" in record["runner_reason"]
    assert "Paris" in record["text"]


@pytest.mark.slow
@needs_embedded_model
@pytest.mark.parametrize("case", list(SPECULATING))
def test_generate_speculates_on_the_runner_the_other_flags_choose(
    case: str, result: subprocess.CompletedProcess[str]
) -> None:
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.splitlines()[0])
    assert record["runner"] == SPECULATING[case][1] and "Paris" in record["text"]
