"""RMSNorm over the last dimension, fused with the residual add that precedes it.

For each row of x (and of residual, when given):

    h = x + residual                      (rounded to the model dtype, as torch's add)
    out = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)     (the mean in float32)

and h is returned as the new residual stream (x itself when there is no residual). The
roundings are those of transformers' eager RMSNorm and of torch's bf16 add, so the fused
kernel and the reference agree to float32 rounding. One launch replaces the seven
elementwise and reduction kernels of the unfused ops plus the add.
"""

import torch

from kernels._checks import (
    check_dtype_and_rank,
    check_same_device,
    check_triton_device,
    need_triton,
)
from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
        x_stride, residual_stride, out_stride, residual_out_stride,
        hidden_size, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        in_row = offsets < hidden_size
        h = tl.load(x_ptr + row * x_stride + offsets, mask=in_row, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(
                residual_ptr + row * residual_stride + offsets, mask=in_row, other=0.0
            ).to(tl.float32)
            rounded = (h + residual).to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row * residual_out_stride + offsets, rounded, mask=in_row)
            h = rounded.to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(h * h, axis=0) / hidden_size + eps)
        normed = (h * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weight_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + row * out_stride + offsets,
            (weight * normed).to(out_ptr.dtype.element_ty),
            mask=in_row,
        )


def _check_args(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        raise ValueError("x must be a floating-point [..., hidden_size] tensor")
    check_dtype_and_rank("weight", weight, x.dtype, 1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} entries, x rows have {x.shape[-1]}")
    if residual is not None:
        check_dtype_and_rank("residual", residual, x.dtype, x.dim())
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        check_same_device(x=x, residual=residual, weight=weight)
    else:
        check_same_device(x=x, weight=weight)


def add_rms_norm_ref(
    x: torch.Tensor,  # [..., hidden_size]
    residual: torch.Tensor | None,  # same shape as x, or None
    weight: torch.Tensor,  # [hidden_size], x's dtype
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual), both like x
    """Torch reference of `add_rms_norm` (transformers' RMSNorm after a plain add)."""
    _check_args(x, residual, weight)
    hidden = x if residual is None else x + residual
    hidden_fp32 = hidden.float()
    inv_rms = torch.rsqrt(hidden_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (hidden_fp32 * inv_rms).to(hidden.dtype), hidden


def add_rms_norm_triton(
    x: torch.Tensor,  # [num_rows, hidden_size], rows contiguous
    residual: torch.Tensor | None,  # [num_rows, hidden_size] or None
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of `add_rms_norm`: one program per row."""
    need_triton("add_rms_norm_triton")
    _check_args(x, residual, weight)
    check_triton_device("add_rms_norm_triton", x.device)
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("add_rms_norm_triton needs 2-D tensors with contiguous rows")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"add_rms_norm_triton needs float32, bfloat16 or float16, got {x.dtype}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    num_rows, hidden_size = x.shape
    out = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    if num_rows == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden_size)
    source = residual if residual is not None else x
    _rms_norm_kernel[(num_rows,)](
        x, source, weight, out, new_residual,
        x.stride(0), source.stride(0), out.stride(0), new_residual.stride(0),
        hidden_size, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False,  # round as torch does
    )  # fmt: skip
    return out, new_residual


def add_rms_norm(
    x: torch.Tensor,  # [..., hidden_size]
    residual: torch.Tensor | None,  # same shape as x, or None
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual = x + residual)
    """RMSNorm of x + residual; the Triton kernel for 2-D CUDA tensors with contiguous
    rows, the torch reference otherwise."""
    if (
        HAS_TRITON
        and x.is_cuda
        and x.dim() == 2
        and x.stride(-1) == 1
        and (residual is None or residual.stride(-1) == 1)
    ):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
