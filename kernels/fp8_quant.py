"""FP8 (e4m3) quantization: activations per token or per 1 x group_size group (Triton
kernels beside their torch references) and load-time weight helpers (torch only).

    quantize_per_token:        x [M, K] -> x_fp8 [M, K] e4m3, scale [M, 1] float32
    quantize_per_token_group:  x [M, K] -> x_fp8 [M, K] e4m3, scale [M, ceil(K / G)] float32

x ~= x_fp8 * scale. A dynamic scale is absmax / 448 (floored at FP8_MIN_SCALE, so that an
all-zero row or group does not divide by zero): the largest value maps to e4m3's largest
finite value. Each value is x / scale (correctly rounded), clamped to +-448 (torch's cast
does not saturate: an out-of-range value would become NaN) and rounded to nearest even.

The kernels round to the e4m3 grid in float32 and then cast a value that is exact in e4m3.
The GPU's cast would round the same way, but Triton's CPU interpreter drops the carry when
rounding up into the next binade (7.9 -> 4.0), and with the rounding done first the
interpreted kernel is bit-exact. The extra ALU work is free in these memory-bound kernels.
"""

from __future__ import annotations

import functools

import torch

from kernels._checks import check_dtype_and_rank, check_triton_device, need_triton
from kernels._triton import HAS_TRITON, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
FP8_MIN_SCALE = 1e-12 / FP8_MAX
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 1024  # per-token kernel: columns per loop iteration
_GROUPS_PER_PROGRAM = 8  # group kernel: ~1K values per program, not 128

if HAS_TRITON:

    @triton.jit
    def _round_to_e4m3_grid(v):
        """v (float32, |v| <= 448) rounded to nearest even on the e4m3 grid: the grid
        spacing is 2^(e - 3) in binade e >= -6 (subnormals share binade -6's spacing), and
        adding 1.5 * 2^23 spacings makes the float32 add round at exactly that spacing."""
        biased_exponent = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
        biased_exponent = tl.maximum(biased_exponent, 127 - 6)
        spacing = ((biased_exponent - 3) << 23).to(tl.float32, bitcast=True)
        magic = spacing * 12582912.0
        return (v + magic) - magic

    @triton.jit
    def _quantize_values(x, scale, FP8_MAX: tl.constexpr):
        q = tl.math.div_rn(x, scale)
        return _round_to_e4m3_grid(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))

    @triton.jit
    def _per_token_kernel(
        x_ptr, q_ptr, scale_ptr, static_scale_ptr, x_stride, q_stride, num_cols, min_scale,
        STATIC: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        if STATIC:
            scale = tl.load(static_scale_ptr)
        else:
            absmax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, num_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(x_row + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
                absmax = tl.maximum(absmax, tl.abs(x))
            scale = tl.maximum(tl.math.div_rn(tl.max(absmax, axis=0), FP8_MAX), min_scale)
        tl.store(scale_ptr + row, scale)
        for start in range(0, num_cols, BLOCK):  # the row's second read mostly hits L2
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
            q = _quantize_values(x, scale, FP8_MAX)
            tl.store(
                q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=cols < num_cols
            )

    @triton.jit
    def _per_group_kernel(
        x_ptr, q_ptr, scale_ptr, x_stride, q_stride, scale_stride_m, scale_stride_g, num_cols,
        group_size, min_scale, FP8_MAX: tl.constexpr, GROUPS: tl.constexpr,
        BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
        in_group = tl.arange(0, BLOCK_G)[None, :]
        cols = groups[:, None] * group_size + in_group  # [GROUPS, BLOCK_G]
        mask = (in_group < group_size) & (cols < num_cols)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        absmax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(tl.math.div_rn(absmax, FP8_MAX), min_scale)  # [GROUPS]
        num_groups = tl.cdiv(num_cols, group_size)
        scale_ptrs = scale_ptr + row * scale_stride_m + groups * scale_stride_g
        tl.store(scale_ptrs, scale, mask=groups < num_groups)
        q = _quantize_values(x, scale[:, None], FP8_MAX)
        tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _device_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def supports_fp8(device: torch.device) -> bool:
    """CUDA compute capability 8.9 (Ada, Hopper) or newer: e4m3 conversions and tensor cores
    in hardware, which the kernels here and torch._scaled_mm need."""
    return device.type == "cuda" and _device_capability(device.index or 0) >= (8, 9)


def _check_activation(x: torch.Tensor, group_size: int = 1) -> None:
    check_dtype_and_rank("x", x, _ACTIVATION_DTYPES, 2)
    if x.shape[1] == 0:
        raise ValueError("x must have at least one column")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")


def _check_static_scale(static_scale: torch.Tensor, device: torch.device) -> None:
    if not isinstance(static_scale, torch.Tensor) or static_scale.numel() != 1:
        raise ValueError("static_scale must be a one-element float32 tensor")
    if static_scale.dtype != torch.float32 or static_scale.device != device:
        actual = f"{static_scale.dtype} on {static_scale.device}"
        raise ValueError(f"static_scale must be float32 on {device}, got {actual}")


def _to_fp8(x_fp32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x_fp32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _absmax_scale(absmax: torch.Tensor) -> torch.Tensor:
    return (absmax.float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)


def quantize_per_token_ref(
    x: torch.Tensor,  # [num_tokens, K] bf16/fp16/fp32
    static_scale: torch.Tensor | None = None,  # one float32 element (checkpoint input_scale)
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [num_tokens, K] e4m3, scale [num_tokens, 1]
    """Torch reference of `quantize_per_token`."""
    _check_activation(x)
    x_fp32 = x.float()
    if static_scale is None:
        scale = _absmax_scale(x_fp32.abs().amax(dim=1, keepdim=True))
    else:
        _check_static_scale(static_scale, x.device)
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return _to_fp8(x_fp32, scale), scale


def quantize_per_token_triton(
    x: torch.Tensor,  # [num_tokens, K] bf16/fp16/fp32, rows contiguous
    static_scale: torch.Tensor | None = None,  # one float32 element
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [num_tokens, K] e4m3, scale [num_tokens, 1]
    """Triton launcher of `quantize_per_token`: one program per row; no host sync, so it
    can be captured in a CUDA graph."""
    need_triton("quantize_per_token_triton")
    _check_activation(x)
    check_triton_device("quantize_per_token_triton", x.device)
    if x.stride(1) != 1:
        raise ValueError("x rows must be contiguous")
    if static_scale is not None:
        _check_static_scale(static_scale, x.device)
    num_tokens, num_cols = x.shape
    x_fp8 = torch.empty((num_tokens, num_cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return x_fp8, scale
    _per_token_kernel[(num_tokens,)](
        x, x_fp8, scale, static_scale if static_scale is not None else scale,
        x.stride(0), x_fp8.stride(0), num_cols, FP8_MIN_SCALE,
        STATIC=static_scale is not None, FP8_MAX=FP8_MAX,
        BLOCK=min(_BLOCK, triton.next_power_of_2(max(num_cols, 16))),
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return x_fp8, scale


def quantize_per_token(
    x: torch.Tensor,  # [num_tokens, K] bf16/fp16/fp32
    static_scale: torch.Tensor | None = None,  # one float32 element (checkpoint input_scale)
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [num_tokens, K] e4m3, scale [num_tokens, 1]
    """Per-token e4m3 quantization: the Triton kernel on fp8-capable GPUs, the torch
    reference otherwise. With `static_scale` every row uses it (returned per row)."""
    if HAS_TRITON and isinstance(x, torch.Tensor) and supports_fp8(x.device) and x.dim() == 2:
        return quantize_per_token_triton(x.contiguous(), static_scale)
    return quantize_per_token_ref(x, static_scale)


def quantize_per_token_group_ref(
    x: torch.Tensor,  # [num_tokens, K] bf16/fp16/fp32
    group_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [M, K] e4m3, scale [M, ceil(K / G)] float32
    """Torch reference of `quantize_per_token_group`."""
    _check_activation(x, group_size)
    num_tokens, num_cols = x.shape
    num_groups = -(-num_cols // group_size)
    x_fp32 = x.float()
    padded = torch.nn.functional.pad(x_fp32, (0, num_groups * group_size - num_cols))
    absmax = padded.view(num_tokens, num_groups, group_size).abs().amax(dim=2)
    scale = _absmax_scale(absmax)  # [num_tokens, num_groups]
    per_value = scale.repeat_interleave(group_size, dim=1)[:, :num_cols]
    return _to_fp8(x_fp32, per_value), scale


def quantize_per_token_group_triton(
    x: torch.Tensor,  # [num_tokens, K] bf16/fp16/fp32, rows contiguous
    group_size: int = 128,
    scale_m_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [M, K] e4m3, scale [M, ceil(K / G)] float32
    """Triton launcher of `quantize_per_token_group`: one program per row and 8 groups."""
    need_triton("quantize_per_token_group_triton")
    _check_activation(x, group_size)
    check_triton_device("quantize_per_token_group_triton", x.device)
    if x.stride(1) != 1:
        raise ValueError("x rows must be contiguous")
    num_tokens, num_cols = x.shape
    num_groups = triton.cdiv(num_cols, group_size)
    x_fp8 = torch.empty((num_tokens, num_cols), dtype=FP8_DTYPE, device=x.device)
    scale = _group_scale_buffer(num_tokens, num_groups, x.device, scale_m_major)
    if num_tokens == 0 or num_groups == 0:
        return x_fp8, scale
    block_g = triton.next_power_of_2(group_size)
    groups = max(1, min(_GROUPS_PER_PROGRAM, 1024 // block_g))
    _per_group_kernel[(num_tokens, triton.cdiv(num_groups, groups))](
        x, x_fp8, scale, x.stride(0), x_fp8.stride(0), scale.stride(0), scale.stride(1),
        num_cols, group_size, FP8_MIN_SCALE, FP8_MAX=FP8_MAX, GROUPS=groups, BLOCK_G=block_g,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return x_fp8, scale


def _group_scale_buffer(
    num_tokens: int, num_groups: int, device: torch.device, m_major: bool
) -> torch.Tensor:  # [num_tokens, num_groups] float32
    """Row-major, or token-major (stride (1, num_tokens)): the layout cuBLASLt's 1 x 128
    block-scaled GEMM reads."""
    if not m_major:
        return torch.empty((num_tokens, num_groups), dtype=torch.float32, device=device)
    return torch.empty((num_groups, num_tokens), dtype=torch.float32, device=device).t()


def quantize_per_token_group(
    x: torch.Tensor,  # [num_tokens, K] bf16/fp16/fp32
    group_size: int = 128,
    scale_m_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [M, K] e4m3, scale [M, ceil(K / G)] float32
    """Per 1 x group_size group e4m3 quantization (DeepSeek-V3 / Qwen3-FP8 activations; a
    last partial group uses its own absmax): Triton on fp8-capable GPUs, else the reference.
    scale_m_major lays the scales out token-major (what `fp8_gemm_blockwise`'s cuBLASLt path
    reads); the values are the same either way."""
    if HAS_TRITON and isinstance(x, torch.Tensor) and supports_fp8(x.device) and x.dim() == 2:
        return quantize_per_token_group_triton(x.contiguous(), group_size, scale_m_major)
    return quantize_per_token_group_ref(x, group_size)


def _check_weight(w: torch.Tensor, ndim: int | None = 2) -> None:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.numel() == 0:
        raise ValueError("w must be a non-empty floating-point tensor")
    if ndim is not None and w.dim() != ndim:
        raise ValueError(f"w must be [N, K], got shape {tuple(w.shape)}")


def quantize_weight_per_channel(
    w: torch.Tensor,  # [N, K] floating
) -> tuple[torch.Tensor, torch.Tensor]:  # w_fp8 [N, K] e4m3, scale [N] float32
    """Load-time per-output-channel quantization: scale[n] = absmax(w[n]) / 448."""
    _check_weight(w)
    w_fp32 = w.float()
    scale = _absmax_scale(w_fp32.abs().amax(dim=1))
    return _to_fp8(w_fp32, scale[:, None]).contiguous(), scale


def quantize_weight_per_tensor(
    w: torch.Tensor,  # [N, K] (any shape) floating
) -> tuple[torch.Tensor, torch.Tensor]:  # w_fp8 like w, e4m3; scale [1] float32
    """Load-time per-tensor quantization: one scale = absmax(w) / 448."""
    _check_weight(w, ndim=None)
    w_fp32 = w.float()
    scale = _absmax_scale(w_fp32.abs().amax().reshape(1))
    return _to_fp8(w_fp32, scale).contiguous(), scale


def dequantize_blockwise(
    w_fp8: torch.Tensor,  # [N, K] e4m3
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block_size: tuple[int, int] = (128, 128),  # (block_n, block_k)
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [N, K] dtype
    """w_fp8 * scale_inv of its block (the Hugging Face "fp8" format: `weight_scale_inv` is
    the factor the fp8 values are multiplied by), computed in float32."""
    check_dtype_and_rank("w_fp8", w_fp8, FP8_DTYPE, 2)
    check_dtype_and_rank("scale_inv", scale_inv, torch.float32, 2)
    block_n, block_k = block_size
    num_rows, num_cols = w_fp8.shape
    expected = (-(-num_rows // block_n), -(-num_cols // block_k))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv must be {expected} for w_fp8 {tuple(w_fp8.shape)} and blocks "
            f"{block_size}, got {tuple(scale_inv.shape)}"
        )
    per_value = scale_inv.repeat_interleave(block_n, dim=0).repeat_interleave(block_k, dim=1)
    return (w_fp8.float() * per_value[:num_rows, :num_cols]).to(dtype)


def dequantize_per_channel(
    w_fp8: torch.Tensor,  # [N, K] e4m3
    scale: torch.Tensor | float,  # [N], [N, 1], [1] or a scalar (0-d tensor or float)
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [N, K] dtype
    """w_fp8 * scale of its row (or of the whole tensor), computed in float32."""
    check_dtype_and_rank("w_fp8", w_fp8, FP8_DTYPE, 2)
    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=w_fp8.device)
    num_rows = w_fp8.shape[0]
    if scale_t.numel() == 1 and scale_t.dim() <= 1:
        scale_t = scale_t.reshape(1, 1)
    elif tuple(scale_t.shape) in ((num_rows,), (num_rows, 1)):
        scale_t = scale_t.reshape(num_rows, 1)
    else:
        raise ValueError(
            f"scale must be [N], [N, 1], [1] or a scalar for w_fp8 {tuple(w_fp8.shape)}, "
            f"got {tuple(scale_t.shape)}"
        )
    return (w_fp8.float() * scale_t).to(dtype)
