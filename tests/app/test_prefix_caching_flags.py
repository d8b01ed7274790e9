"""--no-prefix-caching-outputs reaches EngineConfig (what it does: a chat's next turn hits
its prompt's blocks but not its previous answer, tests/actors/test_prefix_cache_decode.py
and tests/actors/test_prefix_cache_engine.py)."""

from __future__ import annotations

import pytest

from tests._engine_flags import config_from_flags


def test_outputs_are_cached_unless_the_flag_says_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_NO_PREFIX_CACHING_OUTPUTS", raising=False)
    assert config_from_flags().prefix_caching_outputs
    assert not config_from_flags("--no-prefix-caching-outputs").prefix_caching_outputs
    monkeypatch.setenv("TANDEM_NO_PREFIX_CACHING_OUTPUTS", "1")
    assert not config_from_flags().prefix_caching_outputs
