"""--kv-offload-cpu-gb, --kv-offload-disk-path and --kv-offload-disk-gb reach EngineConfig
in bytes; bad combinations are refused in one line (the tiers: tests/actors/test_kv_offload*.py,
tests/gpu/test_kv_offload.py, tests/gpu/test_kv_disk_store.py)."""

from __future__ import annotations

import pytest

from actors.protocol.config import ConfigError
from tests._engine_flags import config_from_flags


def test_the_tiers_are_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CPU_GB", "DISK_PATH", "DISK_GB"):
        monkeypatch.delenv(f"TANDEM_KV_OFFLOAD_{name}", raising=False)
    config = config_from_flags()
    assert config.kv_offload_cpu_bytes == 0 and config.kv_offload_disk_path is None


def test_the_flags_in_bytes(tmp_path: object) -> None:
    config = config_from_flags(
        "--kv-offload-cpu-gb",
        "1.5",
        "--kv-offload-disk-path",
        str(tmp_path),
        "--kv-offload-disk-gb",
        "2",
    )
    assert config.kv_offload_cpu_bytes == 3 << 29
    assert config.kv_offload_disk_path == str(tmp_path)
    assert config.kv_offload_disk_bytes == 2 << 30


def test_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_KV_OFFLOAD_CPU_GB", "0.5")
    assert config_from_flags().kv_offload_cpu_bytes == 1 << 29


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--kv-offload-cpu-gb", "-1"), "kv_offload_cpu_bytes must be >= 0"),
        (("--kv-offload-cpu-gb", "1", "--kv-offload-disk-gb", "-1"), "must be >= 0"),
        (("--kv-offload-disk-path", "/tmp/kv"), "needs --kv-offload-cpu-gb"),
        (("--kv-offload-cpu-gb", "1", "--no-prefix-caching"), "needs prefix caching"),
        (("--kv-offload-cpu-gb", "1", "--tensor-parallel-size", "2"), "tensor-parallel"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        config_from_flags(*argv)
    assert "\n" not in str(refused.value)
