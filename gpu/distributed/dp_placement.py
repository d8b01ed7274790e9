"""Where one engine core of `tandem serve --data-parallel-size N` runs.

Core i of N runs on cuda:i (as vLLM's data-parallel ranks each take their own GPU); the
user chooses the GPUs with CUDA_VISIBLE_DEVICES. On the CPU every core uses the CPU (and
they split its threads: gpu/cpu_threads.py).
"""

from __future__ import annotations

import torch

from actors.protocol.config import ConfigError, EngineConfig


def place_data_parallel_rank(
    config: EngineConfig, num_visible_devices: int | None = None
) -> EngineConfig:
    """`config` with the device of its data-parallel rank; raises ConfigError when the
    machine has fewer visible GPUs than cores. num_visible_devices defaults to
    torch.cuda.device_count() (0 without CUDA)."""
    size, rank = config.data_parallel_size, config.data_parallel_rank
    device = config.device.strip().lower()
    if size == 1 or device == "cpu":
        return config
    if ":" in device:
        raise ConfigError(
            f"--device {config.device} names one GPU, but --data-parallel-size {size} runs "
            f"core i on cuda:i; pass --device cuda (or auto) and choose the GPUs with "
            f"CUDA_VISIBLE_DEVICES"
        )
    if num_visible_devices is None:
        num_visible_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_visible_devices == 0 and device == "auto":
        return config.replace(device="cpu")
    if num_visible_devices < size:
        raise ConfigError(
            f"--data-parallel-size {size} needs {size} GPUs, but {num_visible_devices} "
            f"{'is' if num_visible_devices == 1 else 'are'} visible (see CUDA_VISIBLE_DEVICES)"
        )
    return config.replace(device=f"cuda:{rank}")
