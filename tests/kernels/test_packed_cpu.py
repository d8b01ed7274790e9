"""packed_cpu: torch's CPU int4 GEMM (through the launcher) against the plain torch
reference, shapes that are not whole blocks or groups; GGUF Q4_0 / Q4_1 blocks against
gguf's own numpy dequantization; the generic 32-column quantizer; argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.packed_cpu import (
    INT4_GROUP_SIZE,
    dequantize_int4_groups,
    int4_groups_from_q4_blocks,
    int4_linear_cpu,
    int4_linear_reference,
    pack_int4_for_cpu,
    padded_in_features,
    quantize_int4_groups,
)

gguf = pytest.importorskip("gguf")

# (tokens, out_features, in_features): whole blocks, rows not a multiple of 16, columns
# not a multiple of 32, a single token, no tokens, the embedded model's fused shapes.
SHAPES = [
    (1, 576, 576),
    (3, 100, 96),
    (5, 7, 70),
    (33, 48, 33),
    (0, 32, 64),
    (4, 960, 576),
    (17, 3072, 576),
    (2, 576, 1536),
]


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:  # [rows, cols] float32
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    weight[0] = 0.0  # an all-zero row: scale 0 must not divide by zero
    if rows > 1:
        weight[1, : min(cols, 32)] = 0.25  # a constant group (0.25: a bf16 number)
    return weight


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the product's last bf16 rounding (accumulation order may differ)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.numel():
        scale = expected.float().abs().max().clamp_min(1e-6)
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-8 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_matmul_matches_the_reference(shape: tuple[int, int, int], dtype) -> None:
    num_tokens, out_features, in_features = shape
    codes, scales_zeros = quantize_int4_groups(_weight(out_features, in_features, sum(shape)))
    packed, packed_scales_zeros = pack_int4_for_cpu(codes, scales_zeros)
    assert packed.shape[0] % 16 == 0 and packed.shape[0] - out_features < 16
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    actual = int4_linear_cpu(x, packed, packed_scales_zeros, out_features)
    assert actual.is_contiguous()
    _assert_bf16_close(actual, int4_linear_reference(x, codes, scales_zeros))


def test_the_kernel_reads_each_weight_as_dequantize_says() -> None:
    """Multiplying the identity returns the weights themselves (rounded to bf16)."""
    codes, scales_zeros = quantize_int4_groups(_weight(40, 64, 7))
    packed, packed_scales_zeros = pack_int4_for_cpu(codes, scales_zeros)
    columns = int4_linear_cpu(torch.eye(64), packed, packed_scales_zeros, 40)  # [64, 40]
    expected = dequantize_int4_groups(codes, scales_zeros).t().to(torch.bfloat16).float()
    assert torch.equal(columns, expected)


def test_rows_do_not_depend_on_the_batch() -> None:
    """A row's product is the same alone and in any batch (so V1 and V2 agree)."""
    codes, scales_zeros = quantize_int4_groups(_weight(576, 576, 3))
    packed, packed_scales_zeros = pack_int4_for_cpu(codes, scales_zeros)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2))
    batch = int4_linear_cpu(x, packed, packed_scales_zeros, 576)
    for rows in (1, 2, 7, 16):
        assert torch.equal(
            int4_linear_cpu(x[:rows], packed, packed_scales_zeros, 576), batch[:rows]
        )


@pytest.mark.parametrize("block_type", ["Q4_0", "Q4_1"])
def test_gguf_blocks_keep_their_codes_under_bf16_scales(block_type: str) -> None:
    """gguf's reference quantizer makes the blocks and its numpy dequantizer the weights:
    the int4 groups come within bf16 rounding of them (the codes are the GGUF's own but
    where a rounded scale moves a weight past a midpoint)."""
    qtype = gguf.GGMLQuantizationType[block_type]
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((48, 160)) * 0.1).astype(np.float32)
    values[3] += 2.0  # an offset row: Q4_1's min (and the zero) far from zero
    blocks = gguf.quants.quantize(values, qtype)  # [48, 5 * block bytes] uint8
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))  # [48, 160]
    codes, scales_zeros = int4_groups_from_q4_blocks(
        torch.from_numpy(blocks).reshape(48, 5, -1), block_type
    )
    assert codes.shape == (48, 160) and codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scales_zeros.shape == (48, 5, 2) and scales_zeros.dtype == torch.bfloat16
    got = dequantize_int4_groups(codes, scales_zeros).reshape(48, 5, 32)
    expected = expected.reshape(48, 5, 32)
    group_max = expected.abs().amax(dim=-1, keepdim=True)
    assert ((got - expected).abs() <= 2**-7 * group_max).all()
    nibbles_u8 = torch.from_numpy(blocks).reshape(48, 5, -1)[..., -16:]
    gguf_codes = torch.cat((nibbles_u8 & 15, nibbles_u8 >> 4), dim=-1)  # low nibbles first
    assert (codes.reshape(48, 5, 32) == gguf_codes).float().mean() > 0.99


@pytest.mark.parametrize("block_type", ["Q4_0", "Q4_1"])
def test_gguf_blocks_with_bf16_exact_scales_convert_exactly(block_type: str) -> None:
    """When d (and Q4_1's m + 8 d) are bf16 numbers the int4 groups are the GGUF weights."""
    rng = np.random.default_rng(1)
    rows, groups = 16, 3
    nibbles = rng.integers(0, 16, size=(rows, groups, 32), dtype=np.uint8)
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)  # ggml: low nibbles first
    d = rng.choice([0.5, 0.25, 0.125, 0.0078125], size=(rows, groups, 1)).astype(np.float16)
    fields = [d.view(np.uint8)]
    if block_type == "Q4_1":
        fields.append((-8 * d.astype(np.float32) + 0.25).astype(np.float16).view(np.uint8))
    blocks = np.concatenate([*fields, packed], axis=-1)  # [rows, groups, 18 or 20]
    qtype = gguf.GGMLQuantizationType[block_type]
    expected = gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)
    codes, scales_zeros = int4_groups_from_q4_blocks(torch.from_numpy(blocks), block_type)
    assert torch.equal(codes.reshape(rows, groups, 32), torch.from_numpy(nibbles))
    assert torch.equal(dequantize_int4_groups(codes, scales_zeros), torch.from_numpy(expected))


def test_quantizing_a_float_weight_rounds_each_value_to_its_groups_grid() -> None:
    weight = _weight(24, 70, 5)
    codes, scales_zeros = quantize_int4_groups(weight)
    assert codes.shape == (24, padded_in_features(70)) == (24, 96)
    assert scales_zeros.shape == (24, 3, 2)
    got = dequantize_int4_groups(codes, scales_zeros)[:, :70]
    scale = scales_zeros[..., 0].float().repeat_interleave(INT4_GROUP_SIZE, 1)[:, :70]
    # half a step, plus the bf16 rounding of scale and zero at the group's ends
    assert ((got - weight).abs() <= 0.5 * scale + 2**-7 * weight.abs().max()).all()
    assert torch.equal(got[0], weight[0])  # zeros stay zeros
    assert torch.equal(got[1, :32], weight[1, :32])  # a constant group is exact


def test_the_launcher_checks_its_arguments() -> None:
    codes, scales_zeros = quantize_int4_groups(_weight(32, 64, 9))
    packed, packed_scales_zeros = pack_int4_for_cpu(codes, scales_zeros)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x must be"):
        int4_linear_cpu(x.half().to(torch.int32), packed, packed_scales_zeros, 32)
    with pytest.raises(ValueError, match="do not fit"):
        int4_linear_cpu(torch.randn(2, 96), packed, packed_scales_zeros, 32)
    with pytest.raises(ValueError, match="do not fit"):
        int4_linear_cpu(x, packed, packed_scales_zeros, 33)
    with pytest.raises(ValueError, match="packed_scales_zeros must be"):
        int4_linear_cpu(x, packed, packed_scales_zeros[:1], 32)
    with pytest.raises(ValueError, match="packed_scales_zeros must be"):
        int4_linear_cpu(x, packed, packed_scales_zeros.float(), 32)
    with pytest.raises(ValueError, match="scales_zeros"):
        pack_int4_for_cpu(codes, scales_zeros[:, :1])
    with pytest.raises(ValueError, match="block_type"):
        int4_groups_from_q4_blocks(torch.zeros(2, 1, 18, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="20 bytes"):
        int4_groups_from_q4_blocks(torch.zeros(2, 1, 18, dtype=torch.uint8), "Q4_1")
