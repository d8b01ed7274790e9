"""--cpu-threads / TANDEM_CPU_THREADS reach EngineConfig.cpu_threads; bad values are refused
on one line; `tandem serve` bounds the tokenizers' thread pools of its processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from actors.protocol.config import ConfigError, EngineConfig
from app.serve_cmd import bound_frontend_threads
from tests._engine_flags import config_from_flags


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_CPU_THREADS", raising=False)
    assert config_from_flags().cpu_threads is None
    assert config_from_flags("--cpu-threads", "3").cpu_threads == 3
    monkeypatch.setenv("TANDEM_CPU_THREADS", "5")
    assert config_from_flags().cpu_threads == 5
    assert config_from_flags("--cpu-threads", "2").cpu_threads == 2


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "4"])
def test_the_config_refuses_what_is_not_a_positive_count(bad: object) -> None:
    with pytest.raises(ConfigError, match="cpu_threads must be an integer >= 1"):
        EngineConfig(cpu_threads=bad)  # type: ignore[arg-type]


def test_serve_refuses_zero_threads_on_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--cpu-threads", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "cpu_threads must be an integer >= 1" in lines[0], result.stderr


def test_serve_bounds_the_tokenizers_threads_unless_the_user_chose() -> None:
    environ: dict[str, str] = {}
    bound_frontend_threads(environ)
    assert environ == {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    environ = {"RAYON_NUM_THREADS": "4"}
    bound_frontend_threads(environ)
    assert environ["RAYON_NUM_THREADS"] == "4"
