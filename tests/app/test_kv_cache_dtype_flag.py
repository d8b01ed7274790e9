"""--kv-cache-dtype / TANDEM_KV_CACHE_DTYPE reach EngineConfig.kv_cache_dtype; other values
are refused (the engine side: tests/gpu/test_kv_cache_fp8*.py)."""

from __future__ import annotations

import pytest

from tests._engine_flags import config_from_flags


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_KV_CACHE_DTYPE", raising=False)
    assert config_from_flags().kv_cache_dtype == "auto"
    assert config_from_flags("--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"
    monkeypatch.setenv("TANDEM_KV_CACHE_DTYPE", "fp8_e4m3")
    assert config_from_flags().kv_cache_dtype == "fp8_e4m3"
    assert config_from_flags("--kv-cache-dtype", "auto").kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        config_from_flags("--kv-cache-dtype", "fp16")
