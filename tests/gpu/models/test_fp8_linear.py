"""The FP8 projection (gpu/models/fp8_linear.py) on CPU, where the kernels run their torch
references: per-channel, per-tensor scales expanded per channel, 128x128 block scales and a
static input scale each equal the dequantize-then-multiply reference exactly and the
dequantized linear within FP8's tolerance; and a whole tiny model whose projections run
in FP8 (the precision forced as on a Hopper GPU) stays close to its dequantized twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.fp8_linear import Fp8Weight, linear, projection
from gpu.models.llama import DecoderModel
from gpu.models.precision import Fp8Scheme, resolve_precision
from gpu.weights.hf_loader import load_hf_config, load_hf_dir
from kernels.fp8_quant import (
    dequantize_blockwise,
    dequantize_per_channel,
    quantize_per_token_group_ref,
    quantize_per_token_ref,
)
from tests.gpu._paged_kv_batch import PagedKVBook, model_kv_caches
from tests.gpu._tiny_fp8_checkpoints import (
    FORMATS,
    build_fp8_tiny_model,
    quantize_block,
    quantize_rows,
    write_fp8_checkpoint,
)

N, K, M = 200, 300, 5  # not multiples of 128: partial blocks in both axes


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = 0.05 * torch.randn(N, K, generator=generator)
    x = torch.randn(M, K, generator=generator)
    bias = torch.randn(N, generator=generator)
    return weight, x, bias


def _fp8_weight(scheme: Fp8Scheme, weight: torch.Tensor) -> tuple[Fp8Weight, torch.Tensor]:
    """An Fp8Weight loaded as the loader would, and its dequantized float32 weight."""
    proj = Fp8Weight(N, K, scheme, "cpu")
    if scheme.block:
        w_fp8, scale, dequantized = quantize_block(weight)
        assert proj.block_scale is not None
        proj.block_scale.data.copy_(scale)
    else:
        per_channel = not scheme.quantized_at_load  # exercise both scale shapes
        w_fp8, scale, dequantized = quantize_rows(weight, per_channel)
        assert proj.weight_scale is not None
        proj.weight_scale.data.copy_(scale.reshape(-1).expand(N))  # per tensor -> per channel
    proj.weight.data.copy_(w_fp8)
    return proj, dequantized


SCHEMES = {
    "per_channel": Fp8Scheme(block=False),
    "per_tensor_expanded": Fp8Scheme(block=False, quantized_at_load=True),
    "block": Fp8Scheme(block=True),
    "static_input": Fp8Scheme(block=False, static_input_scale=True),
}


@pytest.mark.parametrize("name", SCHEMES)
def test_fp8_linear_is_the_dequantized_linear_of_quantized_activations(name: str) -> None:
    scheme = SCHEMES[name]
    weight, x, bias = _inputs()
    proj, dequantized = _fp8_weight(scheme, weight)
    if scheme.static_input_scale:
        assert proj.input_scale is not None
        proj.input_scale.data.fill_(x.abs().max().item() / 448.0)
    out = linear(x, proj, bias)
    # The reference: activations quantized by the kernels' references, then float32 math.
    if scheme.block:
        x_fp8, x_scale = quantize_per_token_group_ref(x, 128)
        x_deq = dequantize_blockwise(x_fp8, x_scale, (1, 128), torch.float32)
        w_deq = dequantize_blockwise(proj.weight, proj.block_scale, (128, 128), torch.float32)
    else:
        x_fp8, x_scale = quantize_per_token_ref(x, proj.input_scale)
        x_deq = x_fp8.float() * x_scale
        w_deq = dequantize_per_channel(proj.weight, proj.weight_scale, torch.float32)
    torch.testing.assert_close(w_deq, dequantized)
    torch.testing.assert_close(out, F.linear(x_deq, w_deq, bias), rtol=1e-5, atol=1e-5)
    # ... and the unquantized product within FP8's precision (3 mantissa bits per operand)
    expected = F.linear(x, weight, bias)
    assert (out - expected).norm() < 0.05 * expected.norm()


def test_projection_allocates_what_the_scheme_says() -> None:
    plain = projection(N, K, torch.bfloat16, "cpu")
    assert isinstance(plain, torch.nn.Parameter) and plain.dtype == torch.bfloat16
    block = projection(N, K, torch.bfloat16, "cpu", Fp8Scheme(block=True))
    assert isinstance(block, Fp8Weight) and block.weight.dtype == torch.float8_e4m3fn
    assert block.block_scale is not None and block.block_scale.shape == (2, 3)
    assert block.weight_scale is None and block.input_scale is None
    channel = projection(N, K, torch.bfloat16, "cpu", Fp8Scheme(False, static_input_scale=True))
    assert isinstance(channel, Fp8Weight) and channel.weight_scale is not None
    assert channel.weight_scale.shape == (N,) and channel.input_scale is not None


def test_fused_part_targets_are_views_of_the_fused_tensors() -> None:
    proj = Fp8Weight(384, K, Fp8Scheme(block=True), "cpu")
    targets = proj.part_targets("q", 256, 128)
    assert targets["q.weight"].data_ptr() == proj.weight[256:].data_ptr()
    assert proj.block_scale is not None
    assert targets["q.weight_scale_inv"].data_ptr() == proj.block_scale[2:].data_ptr()
    assert targets["q.weight_scale_inv"].shape == (1, 3)


def _prefill_logits(model: DecoderModel, prompt: torch.Tensor) -> torch.Tensor:
    book = PagedKVBook(64, 4, seed=1)
    positions, metadata = book.step([("r", len(prompt))])
    kv_caches = model_kv_caches(model.config, 64, 4, "cpu")
    with torch.no_grad():
        hidden = model(prompt, positions, kv_caches, metadata)
        return model.compute_logits(hidden[: metadata.num_actual_tokens])


@pytest.mark.slow  # transformers
@pytest.mark.parametrize("name", ["fp8_block", "ct_channel", "ct_static"])
def test_a_model_running_fp8_projections_stays_close_to_its_dequantized_twin(
    tmp_path: Path, name: str
) -> None:
    fmt = FORMATS[name]
    # A flatter init than the CPU tests' 0.15: FP8 noise should not flip most argmaxes.
    hf_model = build_fp8_tiny_model(fmt.architecture, initializer_range=0.05)
    write_fp8_checkpoint(hf_model, fmt, tmp_path / "fp8", tmp_path / "plain")
    config = load_hf_config(str(tmp_path / "fp8"))
    precision = resolve_precision(config, "auto", torch.float32, "cuda", (9, 0))
    assert precision.runs_fp8
    _, weights, _ = load_hf_dir(str(tmp_path / "fp8"), torch.float32, precision=precision)
    fp8_model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu", None, precision)
    fp8_model.load_weights(weights)
    assert isinstance(fp8_model.layers[0].self_attn.qkv_proj, Fp8Weight)
    plain_config, plain_weights, _ = load_hf_dir(str(tmp_path / "plain"), torch.float32)
    plain = DecoderModel(plain_config, TorchAttentionBackend(), torch.float32, "cpu")
    plain.load_weights(plain_weights)
    prompt = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    got, expected = _prefill_logits(fp8_model, prompt), _prefill_logits(plain, prompt)
    assert (got - expected).abs().max() < 0.15 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.85
