"""Argument checks shared by the sampling kernels (kernels/temperature.py, min_p.py, ...).

Each launcher and reference calls these before touching memory, so that a wrong dtype,
shape or device fails with a message naming the argument instead of a kernel fault.
Values (row indices, token ids) are not range-checked here: that would need a host sync.
"""

from __future__ import annotations

import os

import torch


def check_logits(logits: torch.Tensor) -> tuple[int, int]:
    """Checks a [num_rows, vocab_size] float32 contiguous logits tensor; returns its shape."""
    check_tensor("logits", logits, torch.float32, 2, logits.device if _is_tensor(logits) else None)
    return logits.shape[0], logits.shape[1]


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    ndim: int,
    device: torch.device | None,
    shape: tuple[int | None, ...] | None = None,
) -> None:
    """Checks type, dtype, rank, device, contiguity and (None = any) each dim of `shape`."""
    if not _is_tensor(tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but logits are on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if shape is not None:
        for dim, (actual, expected) in enumerate(zip(tensor.shape, shape, strict=True)):
            if expected is not None and actual != expected:
                raise ValueError(f"{name} must have size {expected} in dim {dim}, "
                                 f"got shape {tuple(tensor.shape)}")


def check_same_num_rows(name: str, tensor: torch.Tensor, num_rows: int) -> None:
    """Per-request state tensors ([max_num_reqs, ...]) must agree on the number of rows."""
    if tensor.shape[0] != num_rows:
        raise ValueError(f"{name} has {tensor.shape[0]} request rows, expected {num_rows} "
                         "(one per request row, like the other per-request tensors)")


def check_triton_device(op_name: str, device: torch.device) -> None:
    """Triton kernels need CUDA tensors, except under Triton's CPU interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{op_name} needs CUDA tensors, got {device}")


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)
