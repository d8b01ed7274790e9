"""Weight-only FP8 ("W8A16") GEMM for few tokens: activations x [M, K] in bf16, fp16 or
float32 times e4m3 weights stored [N, K] (nn.Linear's layout), with no activation
quantization: out[m, n] = sum_k x[m, k] * w[n, k] * scale, accumulated in float32 and
rounded once to x's dtype, plus an optional bias [N].

    per channel: w_scale [N] float32, applied to each output column after the sum
    blockwise:   block_scale [ceil(N / 128), ceil(K / 128)] float32 (Hugging Face's
                 `weight_scale_inv`, a multiplier), applied to each 128-wide K block's
                 partial sum before it is accumulated

At batch 1 a projection is a matrix-vector product bound by reading the weight, so the
Triton kernel streams each weight row once: a program owns BLOCK_N output columns (and 16
rows of x) and walks K in BLOCK_K steps with K-contiguous 16-byte loads, converts the fp8
tile to x's dtype in registers (exact) and multiplies on the tensor cores, x padded to 16
rows by masking (tl.dot's smallest M). Where N has
too few column tiles to fill the GPU (k/v and down projections), SPLIT_K programs share a
column tile's K range, write float32 partials [SPLIT_K, M, N], and a second small kernel
adds them in a fixed order (deterministic, no atomics, no zero fill) with the bias.

On CPU, or on GPUs without fp8 conversions (compute capability < 8.9), the launcher runs
the torch reference, which dequantizes the weight and multiplies in float32.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from kernels._checks import (
    check_dtype_and_rank,
    check_same_device,
    check_scale,
    check_triton_device,
    need_triton,
)
from kernels._triton import HAS_TRITON, tl, triton
from kernels.fp8_quant import FP8_DTYPE, dequantize_blockwise, supports_fp8

SCALE_BLOCK = 128  # block_scale covers 128 x 128 weight blocks
_BLOCK_M = 16  # rows of x per program: tl.dot's smallest M
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(
        x_ptr,  # [M, K] bf16/fp16/fp32, rows contiguous
        w_ptr,  # [N, K] e4m3, rows contiguous
        scale_ptr,  # [N] float32, or [ceil(N / 128), ceil(K / 128)] float32 if BLOCKWISE
        bias_ptr,  # [N], read only if HAS_BIAS and SPLIT_K == 1
        out_ptr,  # [M, N] x's dtype if SPLIT_K == 1, else partials [SPLIT_K, M, N] float32
        M, N, K, x_stride, w_stride, out_stride, scale_stride, k_per_split,
        BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):  # fmt: skip
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m, in_n = offs_m < M, offs_n < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)  # no scale read past K's last block
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * w_stride + offs_k[None, :]  # [BN, BK]
        # BLOCK_N divides 128 when BLOCKWISE, so the tile lies in one row of scale blocks.
        scale_row_ptr = scale_ptr + (pid_n * BLOCK_N // 128) * scale_stride
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            in_k = k + offs_k < K
            x = tl.load(x_ptrs + k, mask=in_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs + k, mask=in_n[:, None] & in_k[None, :], other=0.0)
            # Tensor cores with M padded to 16 rows; e4m3 -> bf16/fp16 is exact.
            if UPCAST_DOT:  # the CPU interpreter's dot multiplies 16-bit floats' raw bits
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)),
                              input_precision="ieee")  # fmt: skip
            elif x.dtype == tl.float32:
                part = tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            if BLOCKWISE:  # BLOCK_K divides 128: one scale per tile
                acc += part * tl.load(scale_row_ptr + k // 128)
            else:
                acc += part
        if not BLOCKWISE:
            acc *= tl.load(scale_ptr + offs_n, mask=in_n, other=0.0)[None, :]
        mask = in_m[:, None] & in_n[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
            out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            part_ptr = out_ptr + pid_k.to(tl.int64) * M * N
            part_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(part_ptrs, acc, mask=mask)

    @triton.jit
    def _split_k_sum_kernel(
        part_ptr,  # [SPLIT_K, M, N] float32
        bias_ptr,  # [N], read only if HAS_BIAS
        out_ptr,  # [M, N] x's dtype
        M, N, out_stride,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_n = cols < N
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):  # a fixed order: the same bits every run
            total += tl.load(part_ptr + (split * M + row) * N + cols, mask=in_n, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=in_n, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, total.to(out_ptr.dtype.element_ty), mask=in_n)


class Fp8GemvConfig(NamedTuple):
    """Tiles of `_gemv_kernel` (each program: BLOCK_M = 16 rows of x): see fp8_gemv_config."""

    block_n: int  # output columns (weight rows) per program
    block_k: int  # K elements per loop step
    split_k: int  # programs sharing one column tile's K range
    num_warps: int = 4


def fp8_gemv_config(
    M: int, N: int, K: int, *, blockwise: bool = False, num_sms: int = 132
) -> Fp8GemvConfig:
    """Tiles for x [M, K] @ w [N, K].T, fixed rather than autotuned (autotuning would
    benchmark inside CUDA graph capture); num_sms defaults to the H100 SXM's 132. M and
    blockwise do not change them: the tiles below suit every M <= 16 and both layouts.

    Reading the weight is the whole cost at these M, so the choices serve bandwidth (an
    H100 sweep over BLOCK_N 16..64, BLOCK_K 128..512, SPLIT_K 1..8, M 1..16 and Llama-3.1-8B's
    projections found these within 4% of the best tile for each shape):
    - tl.dot with M padded to 16, even at M = 1: the tensor cores' wasted rows cost nothing,
      while multiplying on the CUDA cores (a broadcast product and a sum) measured 1.1-1.2x
      slower at M = 1 and 3.5-11x at M = 4 (the 3-D product spills registers).
    - BLOCK_N = 32 weight rows x BLOCK_K = 128 e4m3 bytes: each row a whole 128-byte line
      per step, 32 bytes per thread; block scales also need BLOCK_N and BLOCK_K to divide
      128, so that each step's tile has one scale.
    - SPLIT_K (a power of two) doubles until the grid has ~4 programs per SM, which keeps
      enough loads in flight to saturate HBM, while each split keeps >= 4 K steps (the
      down projection, N = 4096 and K = 14336: 128 column tiles x 8 splits).
    """
    del M, blockwise  # see above
    block_n, block_k = 32, 128
    k_steps, tiles = -(-K // block_k), -(-N // block_n)
    split_k = 1
    while tiles * split_k < 4 * num_sms and k_steps // (2 * split_k) >= 4:
        split_k *= 2
    return Fp8GemvConfig(block_n, block_k, split_k)


def _check_args(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor | None,
    block_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    check_dtype_and_rank("x", x, _ACTIVATION_DTYPES, 2)
    check_dtype_and_rank("w_fp8", w_fp8, FP8_DTYPE, 2)
    (num_out, depth), tensors = w_fp8.shape, {"x": x, "w_fp8": w_fp8}
    if x.shape[1] != depth:
        raise ValueError(
            f"x {tuple(x.shape)} and w_fp8 {tuple(w_fp8.shape)} (stored [N, K]) must share K"
        )
    if (w_scale is None) == (block_scale is None):
        raise ValueError("pass exactly one of w_scale [N] and block_scale [N/128, K/128]")
    if w_scale is not None:
        check_scale("w_scale", w_scale, ((num_out,), (num_out, 1)))
        tensors["w_scale"] = w_scale
    if block_scale is not None:
        blocks = (-(-num_out // SCALE_BLOCK), -(-depth // SCALE_BLOCK))
        check_scale("block_scale", block_scale, (blocks,))
        tensors["block_scale"] = block_scale
    if bias is not None:
        check_dtype_and_rank("bias", bias, _ACTIVATION_DTYPES, 1)
        if bias.shape[0] != num_out:
            raise ValueError(f"bias must be [{num_out}], got {list(bias.shape)}")
        tensors["bias"] = bias
    check_same_device(**tensors)


def fp8_gemv_ref(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor | None = None,  # [N] or [N, 1] float32 (per channel), or
    block_scale: torch.Tensor | None = None,  # [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None = None,  # [N] bf16/fp16/fp32 or None
) -> torch.Tensor:  # [M, N] x's dtype
    """Torch reference of `fp8_gemv`: dequantize the weight, multiply and add in float32."""
    _check_args(x, w_fp8, w_scale, block_scale, bias)
    if block_scale is not None:
        block = (SCALE_BLOCK, SCALE_BLOCK)
        w = dequantize_blockwise(w_fp8, block_scale, block, torch.float32)
    else:
        assert w_scale is not None
        w = w_fp8.float() * w_scale.reshape(-1, 1)
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_config(config: Fp8GemvConfig, blockwise: bool) -> None:
    block_n, block_k, split_k, _ = config
    if any(size <= 0 or size & (size - 1) for size in (block_n, block_k, split_k)):
        raise ValueError(f"config block sizes and split_k must be powers of two, got {config}")
    if min(block_n, block_k) < 16:
        raise ValueError(f"tl.dot needs block_n, block_k >= 16, got {config}")
    if blockwise and max(block_n, block_k) > SCALE_BLOCK:
        raise ValueError(f"block scales need block_n, block_k <= 128, got {config}")


def fp8_gemv_triton(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32, rows contiguous
    w_fp8: torch.Tensor,  # [N, K] e4m3, rows contiguous
    w_scale: torch.Tensor | None = None,  # [N] or [N, 1] float32, or
    block_scale: torch.Tensor | None = None,  # [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None = None,  # [N] bf16/fp16/fp32 or None
    config: Fp8GemvConfig | None = None,  # None: fp8_gemv_config's
) -> torch.Tensor:  # [M, N] x's dtype
    """Triton launcher of `fp8_gemv`: one kernel, plus the split-K sum when SPLIT_K > 1.
    Allocates only shape-sized buffers and never syncs: capturable in a CUDA graph."""
    need_triton("fp8_gemv_triton")
    _check_args(x, w_fp8, w_scale, block_scale, bias)
    check_triton_device("fp8_gemv_triton", x.device)
    if x.stride(1) != 1 or w_fp8.stride(1) != 1:
        raise ValueError("x and w_fp8 rows must be contiguous")
    (num_tokens, depth), num_out = x.shape, w_fp8.shape[0]
    blockwise = block_scale is not None
    scale = block_scale if block_scale is not None else w_scale
    assert scale is not None
    scale = scale.contiguous()
    if config is None:
        num_sms = _num_sms(x.device.index or 0) if x.device.type == "cuda" else 132
        config = fp8_gemv_config(num_tokens, num_out, depth, blockwise=blockwise, num_sms=num_sms)
    _check_config(config, blockwise)
    out = torch.empty((num_tokens, num_out), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_out == 0:
        return out
    block_n, block_k, split_k, num_warps = config
    k_per_split = triton.cdiv(triton.cdiv(depth, block_k), split_k) * block_k
    dest = out
    if split_k > 1:
        dest = torch.empty((split_k, num_tokens, num_out), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else scale  # never read without HAS_BIAS
    grid = (triton.cdiv(num_out, block_n), split_k, triton.cdiv(num_tokens, _BLOCK_M))
    _gemv_kernel[grid](
        x, w_fp8, scale, bias_arg, dest, num_tokens, num_out, depth,
        x.stride(0), w_fp8.stride(0), out.stride(0), scale.stride(0), k_per_split,
        BLOCKWISE=blockwise, HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k,
        UPCAST_DOT=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps,
    )  # fmt: skip
    if split_k > 1:
        block = min(1024, triton.next_power_of_2(num_out))
        _split_k_sum_kernel[(num_tokens, triton.cdiv(num_out, block))](
            dest, bias_arg, out, num_tokens, num_out, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32, M small (1..16)
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor | None = None,  # [N] or [N, 1] float32 (per channel), or
    block_scale: torch.Tensor | None = None,  # [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None = None,  # [N] bf16/fp16/fp32 or None
) -> torch.Tensor:  # [M, N] x's dtype
    """x @ dequantized(w_fp8).T + bias with the activations unquantized: the Triton kernel
    on CUDA with fp8 conversions (compute capability >= 8.9), the torch reference
    otherwise. Any M works, but past 16 rows each 16-row tile re-reads the weight and
    fp8_gemm's quantized GEMMs are the better choice."""
    _check_args(x, w_fp8, w_scale, block_scale, bias)
    if HAS_TRITON and supports_fp8(x.device):
        return fp8_gemv_triton(x.contiguous(), w_fp8.contiguous(), w_scale, block_scale, bias)
    return fp8_gemv_ref(x, w_fp8, w_scale, block_scale, bias)
