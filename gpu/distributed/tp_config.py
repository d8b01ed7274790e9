"""Validation of --tensor-parallel-size and --pipeline-parallel-size before any worker
starts."""

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
    pp_size: int = 1,
) -> None:
    """Raise TensorParallelError unless `tp_size` x `pp_size` ranks can run `model` here:
    the model's heads and MLP split evenly over tp_size, its layers over pp_size (at least
    one each), and on CUDA there is one visible device per rank (rank r uses cuda:r, so a
    single --device cuda:N cannot be combined with more than one rank).
    num_visible_devices defaults to torch.cuda.device_count()."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be at least 1, got {tp_size!r}")
    if not isinstance(pp_size, int) or pp_size < 1:
        raise TensorParallelError(f"--pipeline-parallel-size must be at least 1, got {pp_size!r}")
    try:
        check_tensor_parallel_size(model, tp_size)
    except ValueError as exc:
        raise TensorParallelError(f"--tensor-parallel-size {tp_size}: {exc}") from None
    if pp_size > model.num_layers:
        raise TensorParallelError(
            f"--pipeline-parallel-size {pp_size}: the model has {model.num_layers} layers, "
            f"fewer than one per stage"
        )
    num_ranks = tp_size * pp_size
    if device_type != "cuda" or num_ranks == 1:
        return
    flags = _flags(tp_size, pp_size)
    if num_visible_devices is None:
        num_visible_devices = torch.cuda.device_count()
    if num_ranks > num_visible_devices:
        raise TensorParallelError(
            f"{flags} needs {num_ranks} GPUs, but {num_visible_devices} "
            f"{'is' if num_visible_devices == 1 else 'are'} visible (see CUDA_VISIBLE_DEVICES)"
        )
    if ":" in requested_device:
        raise TensorParallelError(
            f"--device {requested_device} names one GPU, but {flags} runs rank r on cuda:r; "
            f"pass --device cuda (or auto) and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )


def _flags(tp_size: int, pp_size: int) -> str:
    parts = [f"--tensor-parallel-size {tp_size}"] if tp_size > 1 else []
    parts += [f"--pipeline-parallel-size {pp_size}"] if pp_size > 1 else []
    return " with ".join(parts)
