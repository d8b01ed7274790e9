"""--kv-cache-dtype / TANDEM_KV_CACHE_DTYPE reach EngineConfig.kv_cache_dtype; other values
are refused (the engine side: tests/gpu/test_kv_cache_fp8*.py)."""

from __future__ import annotations

import argparse

import pytest

from actors.protocol.config import EngineConfig
from app.engine_args import add_engine_args, engine_config_from_args


def _parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_KV_CACHE_DTYPE", raising=False)
    assert _parse().kv_cache_dtype == "auto"
    assert _parse("--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"
    monkeypatch.setenv("TANDEM_KV_CACHE_DTYPE", "fp8_e4m3")
    assert _parse().kv_cache_dtype == "fp8_e4m3"
    assert _parse("--kv-cache-dtype", "auto").kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        _parse("--kv-cache-dtype", "fp16")
