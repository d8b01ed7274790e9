"""FP8 GEMM for few tokens with the activations quantized inside the kernel ("W8A8"): x [M, K]
in bf16, fp16 or float32 times e4m3 weights stored [N, K], both multiplied in e4m3 on the
tensor cores, plus an optional bias [N]. The activations are quantized exactly as the FP8
GEMMs of larger batches quantize them (kernels/fp8_quant.py), so a token's products do not
depend on how many tokens share its step:

    blockwise (block_scale [ceil(N / 128), ceil(K / 128)], Hugging Face's
               `weight_scale_inv`): x per token and 128 columns (quantize_per_token_group);
               each 128 x 128 product is scaled by its weight block's and its x group's scale
               before it is accumulated
    per channel (w_scale [N]): x per token (quantize_per_token), or by a static input_scale
               [1] (a checkpoint's `input_scale`); the sum is scaled once per output

kernels/fp8_gemv.py's weight-only kernel converts every weight byte to x's dtype before its
MMA; here nothing is converted but x, 16 rows per K step against BLOCK_N weight rows. The
product is computed transposed, out.T = w @ x.T, so that the weight tile is the MMA's first
operand: on Hopper, Triton then issues e4m3 x e4m3 warpgroup MMAs (64 weight rows each) with
the tokens as the MMA's N of 16. Each K step's product (128 values deep) is added to a
float32 accumulator in registers, which also keeps the tensor cores' reduced-precision FP8
accumulation to 128 products (DeepSeek-V3's promotion interval).

Tiles and split-K follow fp8_gemv_config (BLOCK_K is always 128: one x group per step);
the split-K partials are added by kernels/fp8_gemv.py's sum kernel. On CPU, or on GPUs
without fp8 support, the launcher runs the torch reference.
"""

from __future__ import annotations

import os

import torch

from kernels._checks import check_triton_device, need_triton
from kernels._triton import HAS_TRITON, tl, triton
from kernels.fp8_gemv import (
    SCALE_BLOCK,
    Fp8GemvConfig,
    _check_args,
    _check_config,
    _num_sms,
    dequantized_weight,
    split_k_destination,
    split_k_for,
    sum_split_k,
)
from kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    quantize_per_token_group_ref,
    quantize_per_token_ref,
    supports_fp8,
)

_BLOCK_M = 16  # token rows per program: tl.dot's smallest N
_BLOCK_K = SCALE_BLOCK  # one activation group (and one weight scale block) per K step

if HAS_TRITON:
    from kernels.fp8_quant import _round_to_e4m3_grid

    @triton.jit
    def _token_scales(
        x_ptr, offs_m, in_m, x_stride, K, min_scale,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
    ):  # fmt: skip
        """[BLOCK_M] per-token scales over the whole of K, as quantize_per_token's."""
        absmax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        row_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :]
        for k in range(0, K, BLOCK_K):
            mask = in_m[:, None] & (k + offs_k < K)[None, :]
            x = tl.load(row_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.max(tl.abs(x), axis=1))
        return tl.maximum(tl.math.div_rn(absmax, FP8_MAX), min_scale)

    @triton.jit
    def _divide(x, divisor, reciprocal):
        """x / divisor correctly rounded, from reciprocal = 1 / divisor correctly rounded: a
        multiply and one correction (the residual x - q * divisor is exact in an FMA), three
        instructions where a correctly rounded division takes a dozen and a call, more than
        the weight conversions this kernel saves. Equal to the division for every finite
        quotient that neither overflows nor falls among the subnormals (Markstein)."""
        quotient = x * reciprocal
        return tl.fma(tl.fma(-quotient, divisor, x), reciprocal, quotient)

    @triton.jit
    def _w8a8_gemv_kernel(
        x_ptr,  # [M, K] bf16/fp16/fp32, rows contiguous
        w_ptr,  # [N, K] e4m3, rows contiguous
        scale_ptr,  # [N] float32, or [ceil(N / 128), ceil(K / 128)] float32 if BLOCKWISE
        input_scale_ptr,  # [1] float32, read only if STATIC_INPUT
        bias_ptr,  # [N], read only if HAS_BIAS and SPLIT_K == 1
        out_ptr,  # [M, N] x's dtype if SPLIT_K == 1, else partials [SPLIT_K, M, N] float32
        M, N, K, x_stride, w_stride, out_stride, scale_stride, k_per_split, min_scale,
        BLOCKWISE: tl.constexpr, STATIC_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, FP8_MAX: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ):  # fmt: skip
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m, in_n = offs_m < M, offs_n < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :]  # [BM, BK]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * w_stride + offs_k[None, :]  # [BN, BK]
        scale_row_ptr = scale_ptr + (pid_n * BLOCK_N // 128) * scale_stride  # BLOCK_N <= 128
        if BLOCKWISE:
            x_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)  # per K step, below
        elif STATIC_INPUT:
            x_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(input_scale_ptr)
        else:
            x_scale = _token_scales(
                x_ptr, offs_m, in_m, x_stride, K, min_scale, BLOCK_M, BLOCK_K, FP8_MAX
            )
        x_inv_scale = tl.math.div_rn(1.0, x_scale)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out.T's tile
        for k in range(k_start, k_end, BLOCK_K):
            in_k = k + offs_k < K
            x = tl.load(x_ptrs + k, mask=in_m[:, None] & in_k[None, :], other=0.0)
            x = x.to(tl.float32)
            w = tl.load(w_ptrs + k, mask=in_n[:, None] & in_k[None, :], other=0.0)
            if BLOCKWISE:  # this step's 128 columns are one group of each token
                absmax = tl.max(tl.abs(x), axis=1)
                # absmax / 448 as quantize_per_token_group divides it (a subnormal quotient
                # is below min_scale either way), without a division call per step
                x_scale = tl.maximum(_divide(absmax, FP8_MAX, 1.0 / FP8_MAX), min_scale)
                x_inv_scale = tl.math.div_rn(1.0, x_scale)
            x_scaled = _divide(x, x_scale[:, None], x_inv_scale[:, None])
            if UPCAST_DOT:  # the CPU interpreter multiplies no e4m3 and misrounds its cast
                x_q = _round_to_e4m3_grid(tl.minimum(tl.maximum(x_scaled, -FP8_MAX), FP8_MAX))
                part = tl.dot(w.to(tl.float32), tl.trans(x_q), input_precision="ieee")
            else:  # cvt.rn.satfinite: the same rounding and clamp in one instruction
                part = tl.dot(w, tl.trans(x_scaled.to(w.dtype)))  # [BN, BM]: e4m3 x e4m3
            if BLOCKWISE:
                acc += part * (x_scale[None, :] * tl.load(scale_row_ptr + k // 128))
            else:
                acc += part
        if not BLOCKWISE:
            w_scale = tl.load(scale_ptr + offs_n, mask=in_n, other=0.0)
            acc *= w_scale[:, None] * x_scale[None, :]
        mask = in_n[:, None] & in_m[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[:, None]
            out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * out_stride + offs_n[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            part_ptr = out_ptr + pid_k.to(tl.int64) * M * N
            part_ptrs = part_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
            tl.store(part_ptrs, acc, mask=mask)


def w8a8_gemv_config(M: int, N: int, K: int, *, num_sms: int = 132) -> Fp8GemvConfig:
    """Tiles for the W8A8 kernel: 64 weight rows (one warpgroup MMA's M: with fewer, Triton
    converts both operands for mma.sync instead, as benchmarks.fp8_gemv_compile shows) by
    128 columns, and fp8_gemv_config's split-K rule for those tiles (not yet swept on a
    GPU)."""
    del M
    block_n = 64
    return Fp8GemvConfig(block_n, _BLOCK_K, split_k_for(N, K, block_n, _BLOCK_K, num_sms))


def _check_w8a8_config(config: Fp8GemvConfig) -> None:
    _check_config(config, blockwise=True)  # block_n <= 128: one scale row per tile
    if config.block_k != _BLOCK_K:
        raise ValueError(f"the W8A8 kernel quantizes x per {_BLOCK_K} columns: block_k "
                         f"must be {_BLOCK_K}, got {config.block_k}")  # fmt: skip


def _check_input_scale(
    input_scale: torch.Tensor | None, block_scale: torch.Tensor | None, x: torch.Tensor
) -> None:
    if input_scale is None:
        return
    if block_scale is not None:
        raise ValueError("input_scale goes with per-channel weights, not block scales")
    if input_scale.dtype != torch.float32 or input_scale.numel() != 1:
        raise ValueError(f"input_scale must be one float32, got {input_scale.dtype} "
                         f"{list(input_scale.shape)}")  # fmt: skip
    if input_scale.device != x.device:
        raise ValueError(f"input_scale is on {input_scale.device}, x on {x.device}")


def quantize_activations_ref(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32
    blockwise: bool,
    input_scale: torch.Tensor | None = None,  # [1] float32 (per-channel weights only)
) -> torch.Tensor:  # [M, K] float32: x as the W8A8 product sees it
    """x quantized to e4m3 and back, as the kernel quantizes it and as the FP8 GEMMs of
    larger batches do: per token and 128 columns for block-scaled weights, else per token
    or by the static input scale."""
    if blockwise:
        x_fp8, scale = quantize_per_token_group_ref(x, SCALE_BLOCK)
        per_value = scale.repeat_interleave(SCALE_BLOCK, dim=1)[:, : x.shape[1]]
        return x_fp8.float() * per_value
    x_fp8, scale = quantize_per_token_ref(x, input_scale)  # scale [M, 1]
    return x_fp8.float() * scale


def fp8_gemv_w8a8_ref(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor | None = None,  # [N] or [N, 1] float32 (per channel), or
    block_scale: torch.Tensor | None = None,  # [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None = None,  # [N] bf16/fp16/fp32 or None
    input_scale: torch.Tensor | None = None,  # [1] float32 (per channel only) or None
) -> torch.Tensor:  # [M, N] x's dtype
    """Torch reference of `fp8_gemv_w8a8`: quantize x, dequantize both, multiply and add in
    float32."""
    _check_args(x, w_fp8, w_scale, block_scale, bias)
    _check_input_scale(input_scale, block_scale, x)
    x_deq = quantize_activations_ref(x, block_scale is not None, input_scale)
    out = x_deq @ dequantized_weight(w_fp8, w_scale, block_scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_gemv_w8a8_triton(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32, rows contiguous
    w_fp8: torch.Tensor,  # [N, K] e4m3, rows contiguous
    w_scale: torch.Tensor | None = None,  # [N] or [N, 1] float32, or
    block_scale: torch.Tensor | None = None,  # [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None = None,  # [N] bf16/fp16/fp32 or None
    input_scale: torch.Tensor | None = None,  # [1] float32 (per channel only) or None
    config: Fp8GemvConfig | None = None,  # None: w8a8_gemv_config's; block_k must be 128
) -> torch.Tensor:  # [M, N] x's dtype
    """Triton launcher of `fp8_gemv_w8a8`: one kernel, plus the split-K sum when SPLIT_K >
    1. Allocates only shape-sized buffers and never syncs: capturable in a CUDA graph."""
    need_triton("fp8_gemv_w8a8_triton")
    _check_args(x, w_fp8, w_scale, block_scale, bias)
    _check_input_scale(input_scale, block_scale, x)
    check_triton_device("fp8_gemv_w8a8_triton", x.device)
    if x.stride(1) != 1 or w_fp8.stride(1) != 1:
        raise ValueError("x and w_fp8 rows must be contiguous")
    (num_tokens, depth), num_out = x.shape, w_fp8.shape[0]
    blockwise = block_scale is not None
    scale = block_scale if block_scale is not None else w_scale
    assert scale is not None  # _check_args: exactly one of them
    scale = scale.contiguous()
    if config is None:
        num_sms = _num_sms(x.device.index or 0) if x.device.type == "cuda" else 132
        config = w8a8_gemv_config(num_tokens, num_out, depth, num_sms=num_sms)
    _check_w8a8_config(config)
    out = torch.empty((num_tokens, num_out), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_out == 0:
        return out
    block_n, block_k, split_k, num_warps = config
    k_per_split = triton.cdiv(triton.cdiv(depth, block_k), split_k) * block_k
    dest = split_k_destination(out, split_k)
    bias_arg = bias if bias is not None else scale  # never read without HAS_BIAS
    input_scale_arg = input_scale if input_scale is not None else scale
    grid = (triton.cdiv(num_out, block_n), split_k, triton.cdiv(num_tokens, _BLOCK_M))
    _w8a8_gemv_kernel[grid](
        x, w_fp8, scale, input_scale_arg, bias_arg, dest, num_tokens, num_out, depth,
        x.stride(0), w_fp8.stride(0), out.stride(0), scale.stride(0), k_per_split,
        FP8_MIN_SCALE, BLOCKWISE=blockwise, STATIC_INPUT=input_scale is not None,
        HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, FP8_MAX=FP8_MAX,
        UPCAST_DOT=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps,
        enable_fp_fusion=False,
    )  # fmt: skip
    sum_split_k(dest, bias, out)
    return out


def fp8_gemv_w8a8(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32, M small (1..16)
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor | None = None,  # [N] or [N, 1] float32 (per channel), or
    block_scale: torch.Tensor | None = None,  # [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None = None,  # [N] bf16/fp16/fp32 or None
    input_scale: torch.Tensor | None = None,  # [1] float32 (per channel only) or None
) -> torch.Tensor:  # [M, N] x's dtype
    """quantized(x) @ dequantized(w_fp8).T + bias: the Triton kernel on CUDA with fp8
    support (compute capability >= 8.9), the torch reference otherwise."""
    if HAS_TRITON and supports_fp8(x.device):
        return fp8_gemv_w8a8_triton(
            x.contiguous(), w_fp8.contiguous(), w_scale, block_scale, bias, input_scale
        )
    return fp8_gemv_w8a8_ref(x, w_fp8, w_scale, block_scale, bias, input_scale)


__all__ = [
    "FP8_DTYPE",
    "fp8_gemv_w8a8",
    "fp8_gemv_w8a8_ref",
    "fp8_gemv_w8a8_triton",
    "quantize_activations_ref",
    "w8a8_gemv_config",
]
