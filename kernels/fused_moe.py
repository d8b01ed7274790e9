"""Fused mixture-of-experts layer: every token through its top_k experts, weighted and summed.

    out[t] = sum_j topk_weights[t, j] * expert_e(hidden[t]),  e = topk_ids[t, j]
    expert_e(x) = act(x @ w13[e].T + b13[e]) @ w2[e].T + b2[e]

Rows [0, I) of w13 are the gate projection, rows [I, 2I) the up projection. Weights are in
the model dtype, MXFP4 (`MXFP4Tensor`, gpt-oss) or FP8 e4m3 (`Fp8Experts`: FP8 checkpoints
such as Qwen3-30B-A3B-FP8, and --quantization fp8) with per-output-channel scales or
128x128 block scales (w13's gate and up halves blocked separately, as the checkpoints'
gate_proj and up_proj are). Products accumulate in float32; the activation is rounded to
the model dtype between the two GEMMs.

FP8 experts are weight-only: the activations stay in the model dtype and are never
quantized. Each weight tile is read as e4m3 (half the bytes of bf16: at decode the experts'
weight bytes are the layer's cost), converted to the activations' dtype in registers
(exactly) and multiplied on the tensor cores with float32 accumulation; the scales
multiply the float32 sums (kernels/_moe_gemm.py). This is the simplest correct design:
no activation quantization launch, the accuracy of the dequantized bf16 model, and the
kernels of the bf16 path with a conversion added.

GPU path, five launches after routing, all with static shapes and no host sync (so a decode
step can be captured in a CUDA graph):
  1-2. group the (token, slot) pairs by expert, padded to blocks of block_m rows
       (kernels/_moe_align.py);
  3.   GEMM 1 with gate and up tiles side by side and the activation (and bias) fused;
  4.   GEMM 2 with bias and routing weight fused, one row per (token, slot);
  5.   sum over the top_k slots of each token (a fixed-order reduction, so outputs are
       the same on every run; no float atomics).
Blocks past the padded row count exit at once; experts that receive no token cost nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kernels._checks import check_triton_device, need_triton
from kernels._moe_align import MoEGrouping, group_pairs_triton, max_num_blocks
from kernels._moe_gemm import (
    ACT_SILU,
    ACT_SWIGLU_CLAMPED,
    WEIGHTS_FP8_BLOCK,
    WEIGHTS_FP8_CHANNEL,
    WEIGHTS_MXFP4,
    WEIGHTS_PLAIN,
)
from kernels._triton import HAS_TRITON, triton
from kernels.fp8_experts import (
    FP8_EXPERT_BLOCK,
    Fp8Experts,
    check_fp8_experts,
    dequantize_fp8_experts,
)
from kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4

if HAS_TRITON:
    from kernels._moe_gemm import _moe_gemm1_kernel, _moe_gemm2_kernel

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Weights = torch.Tensor | MXFP4Tensor | Fp8Experts
GATED_PARTS = 2
"""w13's rows: the gate half, then the up half (each blocked on its own when FP8)."""


@dataclass(frozen=True)
class MoEActivation:
    """The experts' gated activation: `silu` (silu(gate) * up, Qwen3-MoE) or
    `swiglu_clamped` (gpt-oss: gate <= limit, |up| <= limit, (up + 1) * gate *
    sigmoid(alpha * gate))."""

    kind: Literal["silu", "swiglu_clamped"]
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "swiglu_clamped"):
            raise ValueError(f"unknown MoE activation {self.kind!r}")


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of the two grouped GEMMs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


ExpertFormat = Literal["plain", "mxfp4", "fp8"]


def expert_format(w: Weights) -> ExpertFormat:
    """How the experts' weights are stored, which picks the tile table."""
    if isinstance(w, MXFP4Tensor):
        return "mxfp4"
    return "fp8" if isinstance(w, Fp8Experts) else "plain"


def tile_config(num_pairs: int, num_experts: int, fmt: ExpertFormat = "plain") -> TileConfig:
    """Tile sizes from the mean rows per expert, as measured (benchmarks/results/moe_*.json,
    `python -m benchmarks.moe --sweep`): decode (a few rows per expert) wants the smallest
    block_m, since weight bytes, not math, bound it; prefill grows block_m so that each
    weight tile feeds more rows. Experts dequantized in registers take narrower tiles at one
    or two rows per expert (FP8: 72 against 82 us for gpt-oss-20b's layer at one token on
    an H100) and smaller ones at many: MXFP4 stops at block_m 64 (128 measured 1.2x
    slower); FP8 keeps block_n 64 (128x64 tiles 1.4x faster than 128x128 at 128 rows per
    expert, 1.2x at 512). FP8's block_k of 64 or 128 keeps every K tile inside one
    128-column scale block."""
    rows_per_expert = num_pairs / num_experts
    if fmt != "plain" and rows_per_expert <= 2:
        return TileConfig(16, 32, 128, 4, 4)
    if rows_per_expert <= 16:
        return TileConfig(16, 64, 128, 4, 4)
    if fmt == "mxfp4":
        return TileConfig(64, 64, 64, 4, 3)
    if rows_per_expert <= 48:
        return TileConfig(32, 64, 128, 4, 4)
    if rows_per_expert <= 96:
        return TileConfig(64, 64, 64, 4, 3)
    if fmt == "fp8":
        return TileConfig(128, 64, 64, 8, 3)
    return TileConfig(128, 128, 64, 8, 3)


def _weight_shape(w: Weights) -> tuple[int, ...]:
    return tuple(w.shape)


def _check_args(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: Weights,
    w2: Weights,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Returns (num_experts, intermediate_size, hidden_size)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError("hidden must be a [num_tokens, hidden_size] tensor")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    num_tokens, hidden_size = hidden.shape
    if topk_weights.dtype != torch.float32 or topk_weights.dim() != 2:
        raise ValueError("topk_weights must be [num_tokens, top_k] float32")
    if topk_ids.dtype != torch.int32 or topk_ids.shape != topk_weights.shape:
        raise ValueError("topk_ids must be [num_tokens, top_k] int32, like topk_weights")
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows, hidden {num_tokens}")
    shape13, shape2 = _weight_shape(w13), _weight_shape(w2)
    if len(shape13) != 3 or shape13[2] != hidden_size or shape13[1] % 2:
        raise ValueError(f"w13 must be [num_experts, 2 * I, {hidden_size}], got {shape13}")
    num_experts, intermediate = shape13[0], shape13[1] // 2
    if shape2 != (num_experts, hidden_size, intermediate):
        raise ValueError(f"w2 must be {(num_experts, hidden_size, intermediate)}, got {shape2}")
    for name, w, num_parts in (("w13", w13, GATED_PARTS), ("w2", w2, 1)):
        if isinstance(w, torch.Tensor) and w.dtype != hidden.dtype:
            raise ValueError(f"{name} must be {hidden.dtype} like hidden, got {w.dtype}")
        if isinstance(w, Fp8Experts):
            check_fp8_experts(name, w, num_parts)
    for name, bias, width in (
        ("w13_bias", w13_bias, 2 * intermediate),
        ("w2_bias", w2_bias, hidden_size),
    ):
        if bias is not None and tuple(bias.shape) != (num_experts, width):
            raise ValueError(f"{name} must be {(num_experts, width)}, got {tuple(bias.shape)}")
    return num_experts, intermediate, hidden_size


def _activate(gate_up: torch.Tensor, activation: MoEActivation) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation.kind == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(-activation.limit, activation.limit)
    return (up + 1) * gate * torch.sigmoid(activation.alpha * gate)


def _expert_weight(w: Weights, expert: int, num_parts: int) -> torch.Tensor:  # [rows, cols] fp32
    if isinstance(w, MXFP4Tensor):
        return dequantize_mxfp4(w[expert], torch.float32)
    if isinstance(w, Fp8Experts):
        return dequantize_fp8_experts(w.expert(expert), torch.float32, num_parts)[0]
    return w[expert].float()


def fused_moe_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden_size] bf16/fp16/fp32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32
    w13: Weights,  # [num_experts, 2 * intermediate, hidden_size] hidden's dtype, MXFP4 or FP8
    w2: Weights,  # [num_experts, hidden_size, intermediate] hidden's dtype, MXFP4 or FP8
    w13_bias: torch.Tensor | None,  # [num_experts, 2 * intermediate]
    w2_bias: torch.Tensor | None,  # [num_experts, hidden_size]
    activation: MoEActivation,
) -> torch.Tensor:  # [num_tokens, hidden_size] hidden's dtype
    """Torch reference of `fused_moe` (and its CPU path): one pair of matmuls per expert
    that receives tokens, over the gathered rows of those tokens."""
    num_experts, _, _ = _check_args(hidden, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias)
    top_k = topk_ids.shape[1]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.flatten().long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # a host sync on a GPU
    flat_weights = topk_weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate_up = hidden[tokens].float() @ _expert_weight(w13, expert, GATED_PARTS).T
        if w13_bias is not None:
            gate_up += w13_bias[expert].float()
        act = _activate(gate_up, activation).to(hidden.dtype).float()
        expert_out = act @ _expert_weight(w2, expert, 1).T
        if w2_bias is not None:
            expert_out += w2_bias[expert].float()
        out.index_add_(0, tokens, expert_out * flat_weights[pairs, None])
    return out.to(hidden.dtype)


def _weight_args(w: Weights) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, int]:
    """(values, scales, expert stride, row stride, scale expert stride, scale row stride,
    kind: kernels/_moe_gemm.py's WEIGHTS) of a weight as the GEMM kernels read it."""
    if isinstance(w, MXFP4Tensor):
        blocks, scales = w.blocks.contiguous(), w.scales.contiguous()
        values, kind = blocks.view(*blocks.shape[:2], -1), WEIGHTS_MXFP4
    elif isinstance(w, Fp8Experts):
        values, scales = w.weight, w.scale.contiguous()
        kind = WEIGHTS_FP8_BLOCK if w.block else WEIGHTS_FP8_CHANNEL
    else:
        values, scales, kind = w, w, WEIGHTS_PLAIN
    if values.stride(2) != 1:
        raise ValueError("expert weight rows must be contiguous")
    if kind == WEIGHTS_PLAIN:
        scale_strides = (0, 0)
    elif kind == WEIGHTS_FP8_CHANNEL:  # [E, N], read by weight row
        scale_strides = (scales.stride(0), 1)
    else:  # MXFP4 [E, N, K / 32], block FP8 [E, N blocks, K blocks]
        scale_strides = (scales.stride(0), scales.stride(1))
    return values, scales, values.stride(0), values.stride(1), *scale_strides, kind


def fused_moe_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden_size] bf16/fp16/fp32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32
    w13: Weights,  # [num_experts, 2 * intermediate, hidden_size], MXFP4 or FP8
    w2: Weights,  # [num_experts, hidden_size, intermediate], MXFP4 or FP8
    w13_bias: torch.Tensor | None,  # [num_experts, 2 * intermediate]
    w2_bias: torch.Tensor | None,  # [num_experts, hidden_size]
    activation: MoEActivation,
    tile: TileConfig | None = None,
) -> torch.Tensor:  # [num_tokens, hidden_size] hidden's dtype
    """Triton launcher of `fused_moe` (five launches, see the module docstring). `tile`
    overrides the launch shape `tile_config` picks (benchmarks sweep it)."""
    need_triton("fused_moe_triton")
    num_experts, intermediate, hidden_size = _check_args(
        hidden, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias
    )
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    config = tile or tile_config(num_pairs, num_experts, expert_format(w13))
    _check_tile(config, w13, w2)
    check_triton_device("fused_moe_triton", hidden.device)
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden = hidden.contiguous()
    grouping = group_pairs_triton(topk_ids.contiguous(), num_experts, config.block_m)
    intermediate_out = torch.empty(
        (num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device
    )
    _launch_gemm1(hidden, w13, w13_bias, intermediate_out, grouping, top_k, activation, config)
    slot_out = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    route_weights = topk_weights.contiguous().view(-1)
    _launch_gemm2(intermediate_out, w2, w2_bias, route_weights, slot_out, grouping, config)
    return slot_out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def _check_tile(config: TileConfig, w13: Weights, w2: Weights) -> None:
    block_scaled = any(isinstance(w, Fp8Experts) and w.block for w in (w13, w2))
    if block_scaled and FP8_EXPERT_BLOCK % config.block_k:
        raise ValueError(
            f"block-scaled FP8 experts need a block_k that divides {FP8_EXPERT_BLOCK} (one "
            f"scale per K tile), got {config.block_k}"
        )


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_gemm1(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: Weights,  # [num_experts, 2 * intermediate, hidden_size]
    bias: torch.Tensor | None,  # [num_experts, 2 * intermediate]
    out: torch.Tensor,  # [num_pairs, intermediate]
    grouping: MoEGrouping,
    top_k: int,
    activation: MoEActivation,
    config: TileConfig,
) -> None:
    num_pairs, intermediate = out.shape
    values, scales, w_e, w_r, s_e, s_r, kind = _weight_args(w13)
    bias = bias.contiguous() if bias is not None else None
    grid = (grouping.block_expert_ids.shape[0], triton.cdiv(intermediate, config.block_n))
    _moe_gemm1_kernel[grid](
        hidden, values, scales, bias if bias is not None else hidden, out,
        grouping.sorted_pair_ids, grouping.block_expert_ids, grouping.num_padded_rows,
        num_pairs, intermediate, hidden.shape[1], hidden.stride(0),
        w_e, w_r, s_e, s_r, bias.stride(0) if bias is not None else 0,
        activation.alpha, activation.limit,
        TOP_K=top_k,
        HAS_BIAS=bias is not None,
        WEIGHTS=kind,
        ACTIVATION=ACT_SILU if activation.kind == "silu" else ACT_SWIGLU_CLAMPED,
        PRECISION=_precision(hidden.dtype),
        UPCAST_DOT=_interpreted(),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def _launch_gemm2(
    act: torch.Tensor,  # [num_pairs, intermediate] model dtype
    w2: Weights,  # [num_experts, hidden_size, intermediate]
    bias: torch.Tensor | None,  # [num_experts, hidden_size]
    route_weights: torch.Tensor,  # [num_pairs] float32
    out: torch.Tensor,  # [num_pairs, hidden_size]
    grouping: MoEGrouping,
    config: TileConfig,
) -> None:
    num_pairs, hidden_size = out.shape
    values, scales, w_e, w_r, s_e, s_r, kind = _weight_args(w2)
    bias = bias.contiguous() if bias is not None else None
    grid = (grouping.block_expert_ids.shape[0], triton.cdiv(hidden_size, config.block_n))
    _moe_gemm2_kernel[grid](
        act, values, scales, bias if bias is not None else act, route_weights, out,
        grouping.sorted_pair_ids, grouping.block_expert_ids, grouping.num_padded_rows,
        num_pairs, hidden_size, act.shape[1],
        w_e, w_r, s_e, s_r, bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None,
        WEIGHTS=kind,
        PRECISION=_precision(act.dtype),
        UPCAST_DOT=_interpreted(),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, hidden_size] bf16/fp16/fp32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32
    w13: Weights,  # [num_experts, 2 * intermediate, hidden_size] hidden's dtype, MXFP4 or FP8
    w2: Weights,  # [num_experts, hidden_size, intermediate] hidden's dtype, MXFP4 or FP8
    w13_bias: torch.Tensor | None,  # [num_experts, 2 * intermediate]
    w2_bias: torch.Tensor | None,  # [num_experts, hidden_size]
    activation: MoEActivation,
) -> torch.Tensor:  # [num_tokens, hidden_size] hidden's dtype
    """The MoE layer's expert part: the Triton kernels on CUDA, the torch reference
    otherwise (CPU tensors, no Triton)."""
    args = (hidden, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, activation)
    if HAS_TRITON and hidden.is_cuda:
        return fused_moe_triton(*args)
    return fused_moe_ref(*args)


__all__ = [
    "ExpertFormat",
    "Fp8Experts",
    "MoEActivation",
    "MXFP4Tensor",
    "fused_moe",
    "fused_moe_ref",
    "fused_moe_triton",
    "max_num_blocks",
    "TileConfig",
    "expert_format",
    "tile_config",
]
