"""The flags behind runner-selection rule 5, as a user meets them on the command line:
help that says what exists and what does not, and one-line startup errors (exit 2) for
what cannot be served, before any model is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._embedded_model import needs_embedded_model

SAMPLE = "tests.gpu._sample_logits_processor:ForceOrBanTokens"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})


def _tandem(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _last_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("tandem: error: ")
    return last


def test_serve_help_documents_the_flags_and_what_is_not_implemented() -> None:
    text = " ".join(_tandem("serve", "--help").stdout.split())
    for fragment in (
        "-O {0,1,2}, --compile-level {0,1,2}",
        "--logits-processors",
        "--speculative-config",
        "vllm_xargs",
        "Not implemented: sequence parallelism, and pipeline parallelism under an "
        "external launcher",
    ):
        assert fragment in text


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("--logits-processors", "missing_colon"), ("must have the form module:Class",)),
        (("--speculative-config", '{"method": "ngram"'), ("not valid JSON",)),
        (
            ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'),
            ("num_speculative_tokens must be an integer >= 1",),
        ),
    ],
    ids=["processor-form", "spec-json", "spec-value"],
)
def test_serve_refuses_bad_flags_in_one_line(
    args: tuple[str, ...], fragments: tuple[str, ...]
) -> None:
    line = _last_error_line(_tandem("serve", "--port", "0", "--device", "cpu", *args))
    for fragment in fragments:
        assert fragment in line


@pytest.mark.parametrize(
    ("args", "env", "fragments"),
    [
        (
            ("--runner", "v2", "--logits-processors", SAMPLE),
            {},
            ("forces the V2 runner", "does not support custom logits processors", SAMPLE),
        ),
        (
            ("-O1",),
            {"TANDEM_USE_V2_MODEL_RUNNER": "1"},
            ("TANDEM_USE_V2_MODEL_RUNNER forces the V2 runner", "stock torch.compile"),
        ),
        (
            ("--runner", "v2", "--compile-level", "2"),
            {},
            ("--runner v2 forces the V2 runner", "stock torch.compile"),
        ),
        (
            ("--logits-processors", "no_such_module:Proc"),
            {},
            ("cannot import module 'no_such_module'",),
        ),
    ],
    ids=[
        "forced-v2-processors",
        "forced-v2-compile-env",
        "forced-v2-compile-flag",
        "processor-import",
    ],
)
def test_the_engine_refuses_before_loading_the_model(
    args: tuple[str, ...], env: dict[str, str], fragments: tuple[str, ...]
) -> None:
    result = _tandem("generate", "--prompt", "hi", "--device", "cpu", *args, env=env)
    line = _last_error_line(result)
    for fragment in fragments:
        assert fragment in line
    assert "model_loaded" not in result.stderr


@needs_embedded_model  # `serve` resolves the model before its engine refuses
def test_serve_stops_when_its_engine_refuses(tmp_path: Path) -> None:
    result = _tandem(
        "serve",
        "--port",
        "0",
        "--device",
        "cpu",
        "--log-format",
        "console",
        "--runner",
        "v2",
        "--logits-processors",
        SAMPLE,
        env={"TMPDIR": str(tmp_path)},
    )
    assert result.returncode != 0
    assert "does not support custom logits processors" in result.stderr
    assert "model_loaded" not in result.stderr
    assert not list(tmp_path.glob("tandem-*")), "the engine's ipc folder was left behind"


@pytest.mark.slow
@needs_embedded_model
def test_generate_runs_a_logits_processor_on_v1() -> None:
    # ForceOrBanTokens only acts on requests with vllm_xargs; `generate` sends none, so the
    # answer is the plain one, on the runner rule 5 chose.
    result = _tandem(
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--json",
        "--logits-processors",
        SAMPLE,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.splitlines()[0])
    assert record["runner"] == "v1" and "custom logits processors" in record["runner_reason"]
    assert "Paris" in record["text"]


@pytest.mark.slow
@needs_embedded_model
@pytest.mark.parametrize(
    ("extra", "runner"),
    [((), "v2"), (("--logits-processors", SAMPLE), "v1")],
    ids=["v2", "v1-with-processors"],
)
def test_generate_speculates_on_the_runner_the_other_flags_choose(
    extra: tuple[str, ...], runner: str
) -> None:
    result = _tandem(
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--json",
        "--speculative-config",
        NGRAM,
        *extra,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.splitlines()[0])
    assert record["runner"] == runner and "Paris" in record["text"]
