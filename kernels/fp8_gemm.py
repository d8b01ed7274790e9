"""FP8 (e4m3) GEMMs of activations [M, K] with weights stored [N, K] (nn.Linear's layout):
out[m, n] = sum_k a[m, k] * w[n, k] in float32, then rounded to out_dtype.

    fp8_gemm_rowwise:   a scale [M, 1] (per token) x w scale [N] (per channel)
                        -> torch._scaled_mm (cuBLASLt / CUTLASS) on compute capability >= 8.9
    fp8_gemm_blockwise: a scale [M, ceil(K / 128)] (1 x 128 groups) x w scale
                        [ceil(N / 128), ceil(K / 128)] (128 x 128 blocks, Hugging Face's
                        `weight_scale_inv`) -> a Triton kernel (DeepSeek-V3, Qwen3-FP8)

On CPU, or on GPUs without fp8 tensor cores, the launchers run the torch references, which
dequantize and multiply in float32 (CPU serving dequantizes at load and never calls these).
"""

from __future__ import annotations

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

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAS_TRITON:

    @triton.jit
    def _blockwise_kernel(
        a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, M, N, K,
        a_stride, w_stride, out_stride, a_scale_stride_m, a_scale_stride_k,
        w_scale_stride_n, w_scale_stride_k,
        SCALE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        # Programs walk GROUP_M row tiles per column tile, so weight tiles are reused from L2.
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        programs_per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (pid // programs_per_group) * GROUP_M
        rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % programs_per_group) % rows_in_group
        pid_n = (pid % programs_per_group) // rows_in_group

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m = offs_m < M
        in_n = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * a_stride + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * w_stride + offs_k[:, None]  # [BK, BN]
        a_scale_ptrs = a_scale_ptr + offs_m * a_scale_stride_m
        w_scale_ptrs = w_scale_ptr + (offs_n // SCALE_BLOCK_N) * w_scale_stride_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # BLOCK_K is the scale block, so each iteration's product has one scale pair per
        # (row, column); scaling it in float32 also bounds the fp8 tensor cores' reduced
        # accumulation precision to 128 products.
        for k_block in range(0, tl.cdiv(K, BLOCK_K)):
            in_k = offs_k < K - k_block * BLOCK_K
            a = tl.load(a_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
            a_scale = tl.load(a_scale_ptrs + k_block * a_scale_stride_k, mask=in_m, other=0.0)
            w_scale = tl.load(w_scale_ptrs + k_block * w_scale_stride_k, mask=in_n, other=0.0)
            acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def _check_operands(a_fp8: torch.Tensor, w_fp8: torch.Tensor, out_dtype: torch.dtype) -> None:
    check_dtype_and_rank("a_fp8", a_fp8, FP8_DTYPE, 2)
    check_dtype_and_rank("w_fp8", w_fp8, FP8_DTYPE, 2)
    if a_fp8.shape[1] != w_fp8.shape[1]:
        raise ValueError(
            f"a_fp8 {tuple(a_fp8.shape)} and w_fp8 {tuple(w_fp8.shape)} (stored [N, K]) "
            "must share K"
        )
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


def _check_rowwise(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> None:
    _check_operands(a_fp8, w_fp8, out_dtype)
    num_tokens, num_out = a_fp8.shape[0], w_fp8.shape[0]
    check_scale("a_scale", a_scale, ((num_tokens, 1),))
    check_scale("w_scale", w_scale, ((num_out,), (num_out, 1)))
    tensors = {"a_fp8": a_fp8, "a_scale": a_scale, "w_fp8": w_fp8, "w_scale": w_scale}
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise ValueError("bias must be a floating-point tensor or None")
        if tuple(bias.shape) != (num_out,):
            raise ValueError(f"bias must be [{num_out}], got {list(bias.shape)}")
        tensors["bias"] = bias
    check_same_device(**tensors)


def fp8_gemm_rowwise_ref(
    a_fp8: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [M, 1] float32
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N] or [N, 1] float32
    bias: torch.Tensor | None,  # [N] or None
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] out_dtype
    """Torch reference of `fp8_gemm_rowwise`: dequantize, multiply and add in float32."""
    _check_rowwise(a_fp8, a_scale, w_fp8, w_scale, bias, out_dtype)
    a = a_fp8.float() * a_scale
    w = w_fp8.float() * w_scale.reshape(-1, 1)
    out = a @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_gemm_rowwise(
    a_fp8: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [M, 1] float32
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N] or [N, 1] float32
    bias: torch.Tensor | None,  # [N] or None
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] out_dtype
    """(a_fp8 * a_scale) @ (w_fp8 * w_scale).T + bias: torch._scaled_mm with row-wise
    scales on CUDA with fp8 tensor cores when K and N are multiples of 16 (its requirement),
    the torch reference otherwise. No host sync: capturable in a CUDA graph."""
    _check_rowwise(a_fp8, a_scale, w_fp8, w_scale, bias, out_dtype)
    num_out, depth = w_fp8.shape
    if not (supports_fp8(a_fp8.device) and depth % 16 == 0 and num_out % 16 == 0):
        return fp8_gemm_rowwise_ref(a_fp8, a_scale, w_fp8, w_scale, bias, out_dtype)
    # _scaled_mm fuses only a bias of the output's 16-bit dtype; bf16 is the pairing that
    # every backend (cuBLASLt >= 12.9 on 9.0, CUTLASS on 8.9) accepts, others are added after.
    fused_bias = bias if bias is not None and bias.dtype == out_dtype == torch.bfloat16 else None
    out = torch._scaled_mm(
        a_fp8.contiguous(),  # row-major A
        w_fp8.contiguous().t(),  # [K, N] column-major B, as cuBLASLt's fp8 GEMM needs
        scale_a=a_scale.contiguous(),
        scale_b=w_scale.contiguous().view(1, num_out),
        bias=fused_bias,
        out_dtype=out_dtype,
    )
    if bias is not None and fused_bias is None:
        out.add_(bias)
    return out


def _check_blockwise(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    block_size: tuple[int, int],
) -> None:
    _check_operands(a_fp8, w_fp8, out_dtype)
    block_n, block_k = block_size
    if block_n <= 0 or block_k < 32 or block_k & (block_k - 1):
        raise ValueError(
            f"block_size (block_n, block_k) needs block_n > 0 and block_k a power of two "
            f">= 32 (one fp8 dot per scale block), got {block_size}"
        )
    (num_tokens, depth), num_out = a_fp8.shape, w_fp8.shape[0]
    k_blocks = -(-depth // block_k)
    check_scale("a_scale", a_scale, ((num_tokens, k_blocks),))
    check_scale("w_scale", w_scale, ((-(-num_out // block_n), k_blocks),))
    check_same_device(a_fp8=a_fp8, a_scale=a_scale, w_fp8=w_fp8, w_scale=w_scale)


def fp8_gemm_blockwise_ref(
    a_fp8: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [M, ceil(K / block_k)] float32
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    out_dtype: torch.dtype,
    block_size: tuple[int, int] = (128, 128),  # (block_n, block_k)
) -> torch.Tensor:  # [M, N] out_dtype
    """Torch reference of `fp8_gemm_blockwise`: dequantize both, multiply in float32."""
    _check_blockwise(a_fp8, a_scale, w_fp8, w_scale, out_dtype, block_size)
    a = dequantize_blockwise(a_fp8, a_scale, (1, block_size[1]), torch.float32)
    w = dequantize_blockwise(w_fp8, w_scale, block_size, torch.float32)
    return (a @ w.T).to(out_dtype)


def _blockwise_config(num_tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by M, fixed rather than autotuned:
    autotuning would benchmark inside CUDA graph capture. Decode (few rows) takes narrow
    column tiles so that enough programs stream the weight; prefill takes 128 x 128."""
    if num_tokens <= 16:
        return 16, 64, 4, 4
    if num_tokens <= 32:
        return 32, 64, 4, 4
    if num_tokens <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def fp8_gemm_blockwise_triton(
    a_fp8: torch.Tensor,  # [M, K] e4m3, rows contiguous
    a_scale: torch.Tensor,  # [M, ceil(K / block_k)] float32
    w_fp8: torch.Tensor,  # [N, K] e4m3, rows contiguous
    w_scale: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    out_dtype: torch.dtype,
    block_size: tuple[int, int] = (128, 128),  # (block_n, block_k)
) -> torch.Tensor:  # [M, N] out_dtype
    """Triton launcher of `fp8_gemm_blockwise`: one program per output tile."""
    need_triton("fp8_gemm_blockwise_triton")
    _check_blockwise(a_fp8, a_scale, w_fp8, w_scale, out_dtype, block_size)
    check_triton_device("fp8_gemm_blockwise_triton", a_fp8.device)
    if a_fp8.stride(1) != 1 or w_fp8.stride(1) != 1:
        raise ValueError("a_fp8 and w_fp8 rows must be contiguous")
    (num_tokens, depth), num_out = a_fp8.shape, w_fp8.shape[0]
    out = torch.empty((num_tokens, num_out), dtype=out_dtype, device=a_fp8.device)
    if num_tokens == 0:
        return out
    block_m, block_n, num_warps, num_stages = _blockwise_config(num_tokens)
    grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(num_out, block_n),)
    _blockwise_kernel[grid](
        a_fp8, w_fp8, out, a_scale, w_scale, num_tokens, num_out, depth,
        a_fp8.stride(0), w_fp8.stride(0), out.stride(0), a_scale.stride(0), a_scale.stride(1),
        w_scale.stride(0), w_scale.stride(1),
        SCALE_BLOCK_N=block_size[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_size[1],
        GROUP_M=8, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


CUBLAS_BLOCKWISE_MIN_TOKENS = 64
"""From this many rows a 128 x 128 block-scaled GEMM goes to cuBLASLt (torch._scaled_mm,
Hopper) where its probe passed: 2.3x faster than the Triton kernel at 2,048 tokens on an H100
(benchmarks/NOTES.md, "FP8 GEMMs"), as fast below 64 rows. cuBLASLt takes only row counts
that are multiples of 4 (the token-major scales' leading dimension must be 16-byte aligned:
65, 77 or 333 rows are CUBLAS_STATUS_NOT_SUPPORTED on an H100): other counts are padded
with up to 3 zero rows, a copy of the fp8 activations that is small next to the GEMM."""
_cublas_blockwise_ok: dict[int, bool] = {}


def fp8_gemm_blockwise(
    a_fp8: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [M, ceil(K / block_k)] float32, row- or token-major
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    out_dtype: torch.dtype,
    block_size: tuple[int, int] = (128, 128),  # (block_n, block_k)
) -> torch.Tensor:  # [M, N] out_dtype
    """Block-scaled fp8 GEMM (1 x block_k activation groups, block_n x block_k weight
    blocks): cuBLASLt for prefill-sized M on Hopper when the activation scales are
    token-major (`quantize_per_token_group(..., scale_m_major=True)`), else the Triton
    kernel on CUDA with fp8 tensor cores, the torch reference otherwise. No host sync:
    capturable in a CUDA graph."""
    _check_blockwise(a_fp8, a_scale, w_fp8, w_scale, out_dtype, block_size)
    if _takes_cublas_blockwise(a_fp8, a_scale, w_fp8, w_scale, out_dtype, block_size):
        return _cublas_blockwise(a_fp8, a_scale, w_fp8, w_scale, out_dtype)
    if HAS_TRITON and supports_fp8(a_fp8.device):
        return fp8_gemm_blockwise_triton(
            a_fp8.contiguous(), a_scale, w_fp8.contiguous(), w_scale, out_dtype, block_size
        )
    return fp8_gemm_blockwise_ref(a_fp8, a_scale, w_fp8, w_scale, out_dtype, block_size)


def _cublas_blockwise(
    a_fp8: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [M, K / 128] float32, stride (1, M)
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N / 128, K / 128] float32, rows 16-byte aligned
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] out_dtype
    if a_fp8.shape[0] % 4:
        return _cublas_blockwise_padded(a_fp8, a_scale, w_fp8, w_scale, out_dtype)
    # cuBLASLt's 1x128 x 128x128 recipe: A's scales token-major, B = w.T [K, N] column-major
    # with its scales [K / 128, N / 128] K-major (w_scale transposed, a view).
    return torch._scaled_mm(
        a_fp8.contiguous(), w_fp8.contiguous().t(), scale_a=a_scale, scale_b=w_scale.t(),
        out_dtype=out_dtype,
    )  # fmt: skip


def _cublas_blockwise_padded(
    a_fp8: torch.Tensor,  # [M, K] e4m3, M not a multiple of 4
    a_scale: torch.Tensor,  # [M, K / 128] float32, stride (1, M)
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N / 128, K / 128] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] out_dtype, a view of the padded product's first M rows
    num_tokens, depth = a_fp8.shape
    padded_tokens = -(-num_tokens // 4) * 4
    a_padded = torch.empty((padded_tokens, depth), dtype=a_fp8.dtype, device=a_fp8.device)
    a_padded[:num_tokens].copy_(a_fp8)
    a_padded[num_tokens:].zero_()
    scale_padded = torch.empty(
        (a_scale.shape[1], padded_tokens), dtype=a_scale.dtype, device=a_scale.device
    ).t()  # [padded_tokens, K / 128], stride (1, padded_tokens)
    scale_padded[:num_tokens].copy_(a_scale)
    scale_padded[num_tokens:].fill_(1.0)
    out = _cublas_blockwise(a_padded, scale_padded, w_fp8, w_scale, out_dtype)
    return out[:num_tokens]


def _takes_cublas_blockwise(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    block_size: tuple[int, int],
) -> bool:
    (num_tokens, depth), num_out = a_fp8.shape, w_fp8.shape[0]
    shape_ok = (
        a_fp8.is_cuda
        and block_size == (128, 128)
        and num_tokens >= CUBLAS_BLOCKWISE_MIN_TOKENS
        and depth % 128 == 0
        and num_out % 128 == 0
        and out_dtype == torch.bfloat16
        and a_scale.stride(0) == 1
        and a_scale.stride(1) == num_tokens
        and w_scale.stride(1) == 1
        and w_scale.stride(0) % 4 == 0
    )
    return shape_ok and _cublas_blockwise_verified(a_fp8.device)


def _cublas_blockwise_verified(device: torch.device) -> bool:
    """Whether cuBLASLt's block-scaled GEMM runs and matches the Triton kernel on this
    device: probed once, eagerly (never while a CUDA graph is captured: then the Triton
    kernel serves until an eager call has probed)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cublas_blockwise_ok:
        if torch.cuda.is_current_stream_capturing():
            return False
        _cublas_blockwise_ok[index] = _probe_cublas_blockwise(torch.device("cuda", index))
    return _cublas_blockwise_ok[index]


def _probe_cublas_blockwise(device: torch.device) -> bool:
    if not (HAS_TRITON and _device_capability_at_least(device, (9, 0))):
        return False
    from kernels.fp8_experts import quantize_fp8_experts
    from kernels.fp8_quant import quantize_per_token_group

    generator = torch.Generator(device=device).manual_seed(0)
    for num_tokens in (CUBLAS_BLOCKWISE_MIN_TOKENS, 201, 1000):
        x = torch.randn(num_tokens, 512, device=device, generator=generator)
        w = torch.randn(384, 512, device=device, generator=generator)
        experts = quantize_fp8_experts(w[None], block=True)
        w_fp8, w_scale = experts.weight[0], experts.scale[0]
        a_fp8, a_scale = quantize_per_token_group(x.bfloat16(), 128, scale_m_major=True)
        expected = fp8_gemm_blockwise_triton(a_fp8, a_scale, w_fp8, w_scale, torch.bfloat16)
        try:
            actual = _cublas_blockwise(a_fp8, a_scale, w_fp8, w_scale, torch.bfloat16)
        except RuntimeError:
            return False
        if not torch.allclose(actual.float(), expected.float(), rtol=2e-2, atol=0.5):
            return False
    return True


def _device_capability_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= capability
