"""SwiGLU's activation: out = silu(gate) * up, where gate and up are the two halves of
each row of the fused gate/up projection.

    gate_up: [num_tokens, 2 * intermediate]  ->  out: [num_tokens, intermediate]

silu is computed in float32 and rounded to the model dtype before the multiply, as torch's
separate F.silu and mul kernels do; one launch replaces the two.
"""

import torch

from kernels._checks import check_triton_device, need_triton
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 1024

if HAS_TRITON:

    @triton.jit
    def _silu_mul_kernel(
        gate_up_ptr, out_ptr, gate_up_stride, out_stride, intermediate_size, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < intermediate_size
        row_ptr = gate_up_ptr + row * gate_up_stride
        gate = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        up = tl.load(row_ptr + intermediate_size + cols, mask=in_row, other=0.0).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(
            out_ptr + row * out_stride + cols,
            (activated * up).to(out_ptr.dtype.element_ty),
            mask=in_row,
        )


def _check_args(gate_up: torch.Tensor) -> None:
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError("gate_up must be a [num_tokens, 2 * intermediate] tensor")
    if not gate_up.is_floating_point():
        raise ValueError(f"gate_up must be a floating-point tensor, got {gate_up.dtype}")


def silu_mul_ref(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]
) -> torch.Tensor:  # [num_tokens, intermediate]
    """Torch reference of `silu_mul`."""
    _check_args(gate_up)
    gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul_triton(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate], rows contiguous
) -> torch.Tensor:  # [num_tokens, intermediate]
    """Triton launcher of `silu_mul`: one program per (row, block of columns)."""
    need_triton("silu_mul_triton")
    _check_args(gate_up)
    check_triton_device("silu_mul_triton", gate_up.device)
    if gate_up.stride(1) != 1:
        raise ValueError("gate_up rows must be contiguous")
    if gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"silu_mul_triton needs float32, bfloat16 or float16, got {gate_up.dtype}")
    num_tokens, width = gate_up.shape
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(intermediate, _BLOCK_SIZE))
    _silu_mul_kernel[grid](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        intermediate,
        BLOCK=_BLOCK_SIZE,
        enable_fp_fusion=False,
    )
    return out


def silu_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]
) -> torch.Tensor:  # [num_tokens, intermediate]
    """silu(gate) * up: the Triton kernel on CUDA, the torch reference otherwise."""
    if HAS_TRITON and gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)
