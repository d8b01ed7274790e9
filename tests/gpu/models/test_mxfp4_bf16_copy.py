"""--mxfp4-bf16-copy: gpt-oss's MXFP4 experts also kept in the model dtype, which steps with
many rows per expert multiply with (the same products: the copy holds every MXFP4 value
exactly; on a GPU summed in another tile order), while small steps keep reading MXFP4;
refused for a model without MXFP4 experts."""

from __future__ import annotations

import math

import pytest
import torch

from actors.protocol.config import EngineConfig
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.llama import DecoderModel
from gpu.models.moe import (
    BF16_COPY_MIN_ROWS,
    SparseMoE,
    add_mxfp4_bf16_copies,
    mxfp4_bf16_copy_bytes,
)
from gpu.weights.dummy import dummy_weights
from gpu.worker import ModelWorker, WorkerConfigError
from tests._engine_flags import config_from_flags
from tests.gpu.models._moe_cases import _shrunk
from tests.gpu.test_runner_selection import CPU_ONLY
from tests.kernels._triton_interpreter import ON_CUDA


def _gpt_oss_with_mxfp4_experts(device: str, dtype: torch.dtype) -> DecoderModel:
    config = _shrunk("gpt-oss-20b", mxfp4_experts=True, num_layers=2)
    model = DecoderModel(config, TorchAttentionBackend(), dtype, device)
    model.load_weights(dummy_weights(config, dtype, seed=3))
    return model


def _same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal on the CPU (one float32 reference path); on a GPU the copy's bf16 tiles sum in
    another order than MXFP4's: equal up to bf16 rounding at the outputs' scale."""
    if actual.device.type == "cpu":
        return torch.equal(actual, expected)
    scale = float(expected.float().abs().max())
    return bool(((actual.float() - expected.float()).abs() <= 2**-6 * scale).all())


def _token_counts(moe: SparseMoE) -> tuple[int, int]:
    """A step below the copy's threshold of rows per expert, and one at it."""
    num_experts = moe.router.shape[0]
    at_threshold = math.ceil(BF16_COPY_MIN_ROWS * num_experts / moe.top_k)
    return at_threshold // 8, at_threshold


@pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=ON_CUDA)],
)
@torch.no_grad()
def test_large_steps_multiply_with_the_copy_and_get_the_same_outputs(
    device: str, dtype: torch.dtype
) -> None:
    model = _gpt_oss_with_mxfp4_experts(device, dtype)
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(layers) == 2 and all(m.is_mxfp4 for m in layers)
    moe = layers[0]
    generator = torch.Generator().manual_seed(0)
    steps = [
        torch.randn(n, moe.router.shape[1], generator=generator).to(device, dtype)
        for n in _token_counts(moe)
    ]
    before = [moe(x) for x in steps]

    expected_bytes = (
        sum(math.prod(m.w13.shape) + math.prod(m.w2.shape) for m in layers) * dtype.itemsize
    )
    assert mxfp4_bf16_copy_bytes(model) == expected_bytes
    assert add_mxfp4_bf16_copies(model) == expected_bytes
    assert moe.w13_bf16 is not None and moe.w13_bf16.dtype == dtype
    assert all(_same(moe(x), out) for x, out in zip(steps, before, strict=True))

    # Only the small step still reads the MXFP4 tensors.
    moe.w13_blocks.zero_()
    moe.w2_blocks.zero_()
    small, large = (moe(x) for x in steps)
    assert not torch.equal(small, before[0])
    assert torch.equal(large, before[1])


def test_a_model_without_mxfp4_experts_is_refused_in_one_line() -> None:
    config = EngineConfig(model="dummy:smollm2-135m", device="cpu", mxfp4_bf16_copy=True)
    with pytest.raises(WorkerConfigError, match="--mxfp4-bf16-copy: .* keeps no MXFP4 experts"):
        ModelWorker(config, CPU_ONLY)


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_MXFP4_BF16_COPY", raising=False)
    assert config_from_flags().mxfp4_bf16_copy is False
    assert config_from_flags("--mxfp4-bf16-copy").mxfp4_bf16_copy is True
    monkeypatch.setenv("TANDEM_MXFP4_BF16_COPY", "1")
    assert config_from_flags().mxfp4_bf16_copy is True
