"""Validation of --tensor-parallel-size before any worker starts."""

from __future__ import annotations

import torch

from gpu.models.config import ModelConfig
from gpu.models.parallel_layers import check_tensor_parallel_size


class TensorParallelError(ValueError):
    """The tensor-parallel size does not fit the model or the machine; the message says why."""


def validate_tensor_parallel(
    tp_size: int,
    model: ModelConfig,
    device_type: str,
    requested_device: str,
    num_visible_devices: int | None = None,
) -> None:
    """Raise TensorParallelError unless `tp_size` ranks can run `model` here: the model's
    heads and MLP split evenly, and on CUDA there is one visible device per rank (rank r
    uses cuda:r, so a single --device cuda:N cannot be combined with tp_size > 1).
    num_visible_devices defaults to torch.cuda.device_count()."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be at least 1, got {tp_size!r}")
    try:
        check_tensor_parallel_size(model, tp_size)
    except ValueError as exc:
        raise TensorParallelError(f"--tensor-parallel-size {tp_size}: {exc}") from None
    if device_type != "cuda" or tp_size == 1:
        return
    if num_visible_devices is None:
        num_visible_devices = torch.cuda.device_count()
    if tp_size > num_visible_devices:
        raise TensorParallelError(
            f"--tensor-parallel-size {tp_size} needs {tp_size} GPUs, but {num_visible_devices} "
            f"{'is' if num_visible_devices == 1 else 'are'} visible (see CUDA_VISIBLE_DEVICES)"
        )
    if ":" in requested_device:
        raise TensorParallelError(
            f"--device {requested_device} names one GPU, but --tensor-parallel-size {tp_size} "
            f"runs rank r on cuda:r; pass --device cuda (or auto) and choose the GPUs with "
            f"CUDA_VISIBLE_DEVICES"
        )
