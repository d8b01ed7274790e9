"""`tandem` as a user runs it: a subprocess, its stdout, stderr and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._embedded_model import embedded_gguf_path, needs_embedded_model


def _tandem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_subcommands_and_options() -> None:
    top = _tandem("--help")
    assert top.returncode == 0 and "generate" in top.stdout
    sub = _tandem("generate", "--help")
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
def test_generate_answers_paris_and_json_has_fields(tmp_path: Path) -> None:
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("What is 2+2?\n")
    result = _tandem(
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--prompts-file",
        str(prompts_file),
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--json",
    )
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
def test_generate_plain_text() -> None:
    result = _tandem("generate", "--prompt", "What is the capital of France?", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    _assert_one_line_error(
        _tandem("generate", "--prompt", "hi", "--model", str(missing)), str(missing)
    )


def test_corrupt_gguf(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(Path(embedded_gguf_path()).read_bytes()[:4096])
    _assert_one_line_error(
        _tandem("generate", "--prompt", "hi", "--model", str(corrupt)), str(corrupt)
    )


def test_not_a_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a model" * 100)
    _assert_one_line_error(_tandem("generate", "--prompt", "hi", "--model", str(junk)), str(junk))


def test_bad_sampling_parameter() -> None:
    _assert_one_line_error(
        _tandem("generate", "--prompt", "hi", "--temperature", "-1"), "temperature"
    )


def test_unknown_dummy_preset() -> None:
    _assert_one_line_error(
        _tandem("generate", "--prompt", "hi", "--model", "dummy:gpt-17"), "gpt-17"
    )


def test_no_prompts() -> None:
    _assert_one_line_error(_tandem("generate"), "no prompts")


def test_tensor_parallelism_on_v1_is_refused_on_one_line() -> None:
    # The other refusals (heads, devices) are tested in-process: tests/gpu/test_tp_config.py.
    _assert_one_line_error(
        _tandem(
            "generate",
            "--prompt",
            "hi",
            "--device",
            "cpu",
            "--runner",
            "v1",
            "--model",
            "dummy:qwen3-0.6b",
            "-tp",
            "2",
        ),
        "--tensor-parallel-size 2",
        "V1 runner",
    )
