"""`tandem` as a user runs it: a subprocess, its stdout, stderr and exit code. The module's
runs start together, two at a time (tests/_command_batch.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests._command_batch import Command, CommandBatch, cli
from tests._embedded_model import embedded_gguf_path, installed_gguf_path, needs_embedded_model


def _commands(tmp: Path) -> dict[str, Command]:
    """Each test's command(s), under its name; the files they read are written to `tmp`."""
    prompts_file = tmp / "prompts.txt"
    prompts_file.write_text("What is 2+2?\n")
    corrupt = tmp / "corrupt.gguf"
    if installed_gguf_path() is not None:  # else the test skips
        corrupt.write_bytes(Path(embedded_gguf_path()).read_bytes()[:4096])
    junk = tmp / "junk.gguf"
    junk.write_bytes(b"definitely not a model" * 100)
    paris = ("--prompt", "What is the capital of France?")
    hi = ("generate", "--prompt", "hi")
    runs = {
        "test_help_lists_subcommands_and_options:top": ("--help",),
        "test_help_lists_subcommands_and_options:generate": ("generate", "--help"),
        "test_generate_answers_paris_and_json_has_fields": (
            "generate",
            *paris,
            "--prompts-file",
            str(prompts_file),
            "--max-tokens",
            "16",
            "--temperature",
            "0",
            "--json",
        ),
        "test_generate_plain_text": ("generate", *paris, "--max-tokens", "16"),
        "test_missing_model_file": (*hi, "--model", str(tmp / "nope.gguf")),
        "test_corrupt_gguf": (*hi, "--model", str(corrupt)),
        "test_not_a_gguf": (*hi, "--model", str(junk)),
        "test_bad_sampling_parameter": (*hi, "--temperature", "-1"),
        "test_unknown_dummy_preset": (*hi, "--model", "dummy:gpt-17"),
        "test_no_prompts": ("generate",),
        # The other refusals (heads, devices) are tested in-process: tests/gpu/test_tp_config.py.
        "test_what_v1_does_not_run_over_ranks_is_refused_on_one_line": (
            *hi,
            "--device",
            "cpu",
            "--runner",
            "v1",
            "--model",
            "dummy:qwen3-0.6b",
            "-tp",
            "2",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
        ),
    }
    return {name: cli(*args) for name, args in runs.items()}


def test_help_lists_subcommands_and_options(runs: CommandBatch) -> None:
    top = runs.result("test_help_lists_subcommands_and_options:top")
    assert top.returncode == 0 and "generate" in top.stdout
    sub = runs.result("test_help_lists_subcommands_and_options:generate")
    for option in (
        "--prompt",
        "--prompts-file",
        "--raw",
        "--json",
        "--runner",
        "--max-tokens",
        "--temperature",
        "--model",
        "--dtype",
    ):
        assert option in sub.stdout


@pytest.mark.slow
@needs_embedded_model
def test_generate_answers_paris_and_json_has_fields(
    result: subprocess.CompletedProcess[str],
) -> None:
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["What is the capital of France?", "What is 2+2?"]
    assert "Paris" in records[0]["text"]
    for record in records:
        assert record["finish_reason"] in ("stop", "length")
        assert record["runner"] in ("v1", "v2") and record["runner_reason"]
        assert record["token_ids"] and all(isinstance(t, int) for t in record["token_ids"])


@pytest.mark.slow
@needs_embedded_model
def test_generate_plain_text(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_model_file(result: subprocess.CompletedProcess[str], tmp: Path) -> None:
    _assert_one_line_error(result, str(tmp / "nope.gguf"))


def test_corrupt_gguf(result: subprocess.CompletedProcess[str], tmp: Path) -> None:
    embedded_gguf_path()  # skips where the embedded model is not installed
    _assert_one_line_error(result, str(tmp / "corrupt.gguf"))


def test_not_a_gguf(result: subprocess.CompletedProcess[str], tmp: Path) -> None:
    _assert_one_line_error(result, str(tmp / "junk.gguf"))


def test_bad_sampling_parameter(result: subprocess.CompletedProcess[str]) -> None:
    _assert_one_line_error(result, "temperature")


def test_unknown_dummy_preset(result: subprocess.CompletedProcess[str]) -> None:
    _assert_one_line_error(result, "gpt-17")


def test_no_prompts(result: subprocess.CompletedProcess[str]) -> None:
    _assert_one_line_error(result, "no prompts")


def test_what_v1_does_not_run_over_ranks_is_refused_on_one_line(
    result: subprocess.CompletedProcess[str],
) -> None:
    _assert_one_line_error(result, "--speculative-config", "V1 runner over several ranks")
