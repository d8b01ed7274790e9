"""Argument checks shared by the kernel files (kernels/<op>.py).

Each launcher and reference calls these before touching memory, so that a wrong dtype,
shape or device fails with a message naming the argument instead of a kernel fault.
Values (row indices, token ids, positions) are not range-checked here: that would need
a host sync.
"""

from __future__ import annotations

import os

import torch

from kernels._triton import HAS_TRITON


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
    """Checks type, dtype, rank, device (that of the logits), contiguity and (None = any)
    each dim of `shape`."""
    check_dtype_and_rank(name, tensor, dtype, ndim)
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but logits are on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if shape is not None:
        for dim, (actual, expected) in enumerate(zip(tensor.shape, shape, strict=True)):
            if expected is not None and actual != expected:
                raise ValueError(
                    f"{name} must have size {expected} in dim {dim}, "
                    f"got shape {tuple(tensor.shape)}"
                )


def check_scale(name: str, scale: torch.Tensor, shapes: tuple[tuple[int, ...], ...]) -> None:
    """Checks that a quantization scale is a float32 tensor of one of `shapes`."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor, got {getattr(scale, 'dtype', scale)}")
    if tuple(scale.shape) not in shapes:
        listing = " or ".join(str(list(shape)) for shape in shapes)
        raise ValueError(f"{name} must be {listing}, got {list(scale.shape)}")


def check_dtype_and_rank(
    name: str, tensor: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...], ndim: int
) -> None:
    """Checks that `tensor` is a tensor of (one of) `dtype` with `ndim` dimensions."""
    if not _is_tensor(tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if tensor.dtype not in allowed:
        raise ValueError(f"{name} must be {' or '.join(map(str, allowed))}, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")


def check_same_num_rows(name: str, tensor: torch.Tensor, num_rows: int) -> None:
    """Per-request state tensors ([max_num_reqs, ...]) must agree on the number of rows."""
    if tensor.shape[0] != num_rows:
        raise ValueError(
            f"{name} has {tensor.shape[0]} request rows, expected {num_rows} "
            "(one per request row, like the other per-request tensors)"
        )


def check_offsets(name: str, offsets: torch.Tensor, num_reqs: int, exact: bool = False) -> None:
    """Prefix sums over `num_reqs` rows: num_reqs + 1 entries (or more where the tensor is
    padded, unless `exact`)."""
    num_entries = offsets.shape[0]
    if num_entries < num_reqs + 1 or (exact and num_entries != num_reqs + 1):
        raise ValueError(f"{name} needs num_reqs + 1 = {num_reqs + 1} entries, has {num_entries}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All named tensors must share one device, which is returned."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    return devices.pop()


def check_token_history_device(token_ids: torch.Tensor, device: torch.device) -> None:
    """The token history may live in pinned host memory that the GPU accesses through UVA."""
    uva_history = device.type == "cuda" and token_ids.device.type == "cpu" and token_ids.is_pinned()
    if token_ids.device != device and not uva_history:
        raise ValueError(
            f"token_ids is on {token_ids.device} but the other tensors are on {device}; "
            "it must be on the same device, or pinned host memory for a CUDA step"
        )


def check_step_counts(step_counts: torch.Tensor | None, device: torch.device) -> None:
    """The device-side (num_reqs, num_tokens) of a step whose launch extent is padded."""
    if step_counts is None:
        return
    check_dtype_and_rank("step_counts", step_counts, torch.int32, 1)
    if step_counts.shape[0] < 2 or step_counts.device != device:
        raise ValueError(
            f"step_counts must hold [num_reqs, num_tokens] on {device}, got "
            f"{tuple(step_counts.shape)} on {step_counts.device}"
        )


def read_step_counts(
    step_counts: torch.Tensor | None, num_reqs: int, num_tokens: int | None
) -> tuple[int, int | None]:
    """The real counts for a torch reference (a host sync on a GPU): step_counts when given,
    which must lie within the bounds num_reqs / num_tokens (None: unbounded)."""
    if step_counts is None:
        return num_reqs, num_tokens
    real_reqs, real_tokens = (int(v) for v in step_counts[:2].tolist())
    token_bound = real_tokens if num_tokens is None else num_tokens
    if not (0 <= real_reqs <= num_reqs and 0 <= real_tokens <= token_bound):
        raise ValueError(
            f"step_counts ({real_reqs}, {real_tokens}) exceed the bounds ({num_reqs}, {num_tokens})"
        )
    return real_reqs, real_tokens


def need_triton(op_name: str) -> None:
    """Launchers fail clearly on a CPU-only install, where only the references run."""
    if not HAS_TRITON:
        raise RuntimeError(f"{op_name} needs Triton, which is not installed")


def check_triton_device(op_name: str, device: torch.device) -> None:
    """Triton kernels need CUDA tensors, except under Triton's CPU interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{op_name} needs CUDA tensors, got {device}")


def check_contiguous_rows(**tensors: torch.Tensor) -> None:
    """Kernels index 1-D tensors and the rows of 2-D ones with unit stride."""
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and tensor.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous (stride(1) == 1)")
        if tensor.dim() == 1 and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def check_row_state(
    num_computed_tokens: torch.Tensor,
    total_len: torch.Tensor,
    token_ids: torch.Tensor,
    last_sampled: torch.Tensor,
) -> None:
    """The runner's per-row state that the post-update kernels advance: [max_num_reqs]
    int32 counts, the [max_num_reqs, max_model_len] int32 history and the [max_num_reqs]
    int64 last tokens, one entry per request row."""
    check_dtype_and_rank("num_computed_tokens", num_computed_tokens, torch.int32, 1)
    check_dtype_and_rank("total_len", total_len, torch.int32, 1)
    check_dtype_and_rank("token_ids", token_ids, torch.int32, 2)
    check_dtype_and_rank("last_sampled", last_sampled, torch.int64, 1)
    num_rows = token_ids.shape[0]
    if not num_computed_tokens.shape[0] == total_len.shape[0] == last_sampled.shape[0] == num_rows:
        raise ValueError(
            "num_computed_tokens, total_len, last_sampled and token_ids must have "
            "one entry per request row"
        )
