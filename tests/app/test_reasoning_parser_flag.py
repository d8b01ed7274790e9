"""--reasoning-parser and --enable-auto-tool-choice as vLLM command lines use them: the
flag, its environment variable and its help; a parser that cannot read the model's chat
format is refused in one line (exit 2) before anything starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from app.cli import build_parser
from app.cli_errors import UserFacingError
from app.serve_checks import check_serve_args
from app.serve_cmd import settings_from_args
from tests._command_batch import Command, cli

GPT_OSS = "dummy:gpt-oss-20b"


def _commands(tmp: Path) -> dict[str, Command]:
    return {
        "test_refusal_is_one_line": cli(
            "serve", "--port", "0", "--reasoning-parser", "openai_gptoss", timeout_s=120
        )
    }


def _checked(*flags: str) -> str:
    args = build_parser().parse_args(["serve", *flags])
    check_serve_args(args)
    parser: str = settings_from_args(args).reasoning_parser
    return parser


def _refusal(*flags: str) -> str:
    with pytest.raises(UserFacingError) as caught:
        _checked(*flags)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_vllm_command_lines_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_REASONING_PARSER", raising=False)
    assert _checked() == "none"
    vllm_flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert _checked(*vllm_flags, "--reasoning-parser", "qwen3") == "qwen3"
    assert _checked("--reasoning-parser", "deepseek_r1") == "deepseek_r1"
    assert _checked("--model", GPT_OSS, "--reasoning-parser", "openai_gptoss") == "openai_gptoss"
    assert _checked("--model", GPT_OSS) == "none"
    monkeypatch.setenv("TANDEM_REASONING_PARSER", "deepseek_r1")
    assert _checked() == "deepseek_r1"
    assert _checked("--reasoning-parser", "qwen3") == "qwen3"
    monkeypatch.setenv("TANDEM_ENABLE_AUTO_TOOL_CHOICE", "1")
    assert build_parser().parse_args(["serve"]).enable_auto_tool_choice is True


def test_unknown_parser_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "granite"])


def test_the_parser_must_fit_the_models_chat_format(tmp_path: Path) -> None:
    message = _refusal("--reasoning-parser", "openai_gptoss")
    assert "--reasoning-parser openai_gptoss" in message and "not a gpt-oss model" in message
    for parser in ("qwen3", "deepseek_r1"):
        message = _refusal("--model", GPT_OSS, "--reasoning-parser", parser)
        assert f"--reasoning-parser {parser}" in message and "openai_gptoss or none" in message
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert "gpt-oss model" in _refusal("--model", str(tmp_path), "--reasoning-parser", "qwen3")


def test_refusal_is_one_line(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("tandem: error: --reasoning-parser openai_gptoss")


def test_help_names_the_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--reasoning-parser {none,qwen3,deepseek_r1,openai_gptoss}" in text
    assert "--enable-auto-tool-choice" in text and "TANDEM_REASONING_PARSER" in text
    assert "answers without thinking" in text
