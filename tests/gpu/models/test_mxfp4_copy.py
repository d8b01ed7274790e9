"""--mxfp4-copy: gpt-oss's MXFP4 experts also kept in bf16 or FP8, which steps with many
rows per expert (bf16) or every step (FP8) multiply with (the same products: either copy
holds every MXFP4 value of these weights exactly; on a GPU summed in another tile order),
while the bf16 copy's small steps keep reading MXFP4 and the FP8 copy replaces them;
refused for a model without MXFP4 experts."""

from __future__ import annotations

import math

import pytest
import torch

from actors.protocol.config import ConfigError, EngineConfig
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.llama import DecoderModel
from gpu.models.moe import COPY_MIN_ROWS, SparseMoE
from gpu.models.mxfp4_copy import add_mxfp4_copies, mxfp4_copy_bytes, mxfp4_copy_description
from gpu.weights.dummy import dummy_weights
from gpu.worker import ModelWorker, WorkerConfigError
from kernels.fp8_experts import Fp8Experts
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
    """A step below the bf16 copy's threshold of rows per expert, and one at it."""
    num_experts = moe.router.shape[0]
    at_threshold = math.ceil(COPY_MIN_ROWS["bf16"] * num_experts / moe.top_k)
    return at_threshold // 8, at_threshold


def _expected_bytes(layers: list[SparseMoE], kind: str, dtype: torch.dtype) -> int:
    shapes = [w.shape for m in layers for w in (m.w13, m.w2)]
    if kind == "bf16":
        return sum(math.prod(shape) for shape in shapes) * dtype.itemsize
    return sum(e * n * k + e * n * 4 for e, n, k in shapes)  # e4m3 + a float32 scale a row


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=ON_CUDA)],
)
@torch.no_grad()
def test_large_steps_multiply_with_the_copy_and_get_the_same_outputs(
    device: str, dtype: torch.dtype, kind: str
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

    expected_bytes = _expected_bytes(layers, kind, dtype)
    assert mxfp4_copy_bytes(model, kind) == expected_bytes
    report = add_mxfp4_copies(model, kind)
    assert report.num_bytes == expected_bytes and report.num_rounded == 0
    assert moe.expert_copy is not None
    w13_copy = moe.expert_copy[0]
    if kind == "fp8":
        assert isinstance(w13_copy, Fp8Experts) and not w13_copy.block
    else:
        assert isinstance(w13_copy, torch.Tensor) and w13_copy.dtype == dtype
    with_copy = [moe(x) for x in steps]
    assert all(_same(out, ref) for out, ref in zip(with_copy, before, strict=True))

    if kind == "fp8":  # it serves every step, so it replaced the MXFP4 experts
        names = {name for layer in layers for name, _ in layer.named_parameters()}
        assert not {"w13_blocks", "w13_scales", "w2_blocks", "w2_scales"} & names
        assert all(m.mxfp4_dropped and m.w13 is m.expert_copy[0] for m in layers)  # type: ignore[index]
        assert mxfp4_copy_bytes(model, kind) == 0  # nothing left to copy
        return
    # With the bf16 copy only the small step still reads the MXFP4 tensors.
    moe.w13_blocks.zero_()
    moe.w2_blocks.zero_()
    small, large = (moe(x) for x in steps)
    assert not torch.equal(small, with_copy[0])
    assert torch.equal(large, with_copy[1])


def test_a_model_without_mxfp4_experts_is_refused_in_one_line() -> None:
    config = EngineConfig(model="dummy:smollm2-135m", device="cpu", mxfp4_copy="fp8")
    with pytest.raises(WorkerConfigError, match="--mxfp4-copy fp8: .* keeps no MXFP4 experts"):
        ModelWorker(config, CPU_ONLY)


def test_the_flag_its_environment_variable_and_a_bad_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TANDEM_MXFP4_COPY", raising=False)
    assert config_from_flags().mxfp4_copy == "none"
    assert config_from_flags("--mxfp4-copy", "fp8").mxfp4_copy == "fp8"
    monkeypatch.setenv("TANDEM_MXFP4_COPY", "bf16")
    assert config_from_flags().mxfp4_copy == "bf16"
    with pytest.raises(ConfigError, match="mxfp4_copy must be none, bf16 or fp8, got 'fp4'"):
        EngineConfig(model="default", mxfp4_copy="fp4")  # type: ignore[arg-type]


def test_the_precision_line_says_which_steps_each_copy_serves() -> None:
    assert mxfp4_copy_description("fp8") == (
        "fp8 copy of the mxfp4 experts for every step, which replaces them"
    )
    assert mxfp4_copy_description("bf16").endswith("steps of >= 64 rows per expert")
