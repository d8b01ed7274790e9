"""--tensor-parallel-size validation and its refusal at startup, before any weight loads."""

from __future__ import annotations

import pytest

from actors.core.engine_startup import load_engine
from actors.protocol.config import ConfigError, EngineConfig
from gpu.distributed.tp_config import TensorParallelError, validate_tensor_parallel
from gpu.models.presets import PRESETS
from tests._embedded_model import needs_embedded_model
from tests._engine_flags import config_from_flags

LLAMA_8B = PRESETS["llama-3.1-8b"]


def test_the_flag_its_short_form_and_its_environment_variable(monkeypatch) -> None:
    assert config_from_flags().tensor_parallel_size == 1
    assert config_from_flags("--tensor-parallel-size", "4").tensor_parallel_size == 4
    assert config_from_flags("-tp", "2").tensor_parallel_size == 2
    monkeypatch.setenv("TANDEM_TENSOR_PARALLEL_SIZE", "8")
    assert config_from_flags().tensor_parallel_size == 8
    assert config_from_flags("-tp", "2").tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize(
    ("tp_size", "device_type", "device", "num_devices", "message"),
    [
        (3, "cuda", "cuda", 8, "does not divide its 32 attention heads"),
        (3, "cpu", "cpu", 0, "does not divide its 32 attention heads"),
        (4, "cuda", "auto", 2, "needs 4 GPUs, but 2 are visible"),
        (2, "cuda", "cuda", 1, "needs 2 GPUs, but 1 is visible"),
        (2, "cuda", "cuda:1", 8, "--device cuda:1 names one GPU"),
    ],
)
def test_sizes_the_model_or_the_machine_cannot_take(
    tp_size, device_type, device, num_devices, message
) -> None:
    with pytest.raises(TensorParallelError, match=message):
        validate_tensor_parallel(tp_size, LLAMA_8B, device_type, device, num_devices)


def test_an_mlp_width_that_does_not_split_is_refused() -> None:
    odd_mlp = LLAMA_8B.replace(intermediate_size=14000)
    with pytest.raises(TensorParallelError, match="MLP width 14000"):
        validate_tensor_parallel(32, odd_mlp, "cuda", "cuda", 32)


@pytest.mark.parametrize(
    ("tp_size", "device_type", "num_devices"),
    [(1, "cuda", 1), (2, "cuda", 2), (8, "cuda", 8), (4, "cpu", 0)],
)
def test_sizes_that_fit(tp_size, device_type, num_devices) -> None:
    validate_tensor_parallel(tp_size, LLAMA_8B, device_type, "auto", num_devices)


@needs_embedded_model
def test_startup_refuses_a_size_that_does_not_divide_the_heads_before_loading() -> None:
    with pytest.raises(TensorParallelError, match="9 attention heads"):
        load_engine(EngineConfig(model="default", device="cpu", tensor_parallel_size=2))


def test_startup_refuses_tensor_parallelism_the_runner_cannot_run_before_loading() -> None:
    with pytest.raises(ConfigError, match="--compile-level with the V1 runner over several"):
        load_engine(
            EngineConfig(
                model="dummy:qwen3-0.6b",
                device="cpu",
                runner="v1",
                tensor_parallel_size=2,
                compile_level=1,
            )
        )
