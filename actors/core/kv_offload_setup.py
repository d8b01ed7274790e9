"""Startup of the prefix cache's offload tiers: size the host slots and the disk bound from
the configuration and the worker's bytes per block, make the worker's host pool, and say
what was made (the startup log, /version)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from actors.core.kv_offload import KVOffload
from actors.protocol.config import EngineConfig
from gpu.kv_disk_store import DiskStore
from gpu.kv_offload import attach_host_pool
from gpu.worker import ModelWorker

log = structlog.get_logger("tandem.kv_offload")


@dataclass(frozen=True, slots=True)
class OffloadTiers:
    offload: KVOffload
    description: str
    """One line for /version and the startup log, e.g. 'cpu 4096 blocks (8.0 GiB, pinned)'."""
    loads_done_through: Callable[[], int]
    """The worker's newest finished load (HostKVPool.loads_done_through)."""


def make_offload_tiers(worker: ModelWorker, config: EngineConfig) -> OffloadTiers | None:
    """The tiers `config` asks for, or None (off, or too small for one block: a warning)."""
    if not config.kv_offload_cpu_bytes or not config.enable_prefix_caching:
        return None
    bytes_per_block = worker.kv_spec.bytes_per_block
    num_host_slots = config.kv_offload_cpu_bytes // bytes_per_block
    if num_host_slots == 0:
        log.warning(
            "kv_offload_off",
            reason=f"--kv-offload-cpu-gb holds no block of {bytes_per_block} bytes",
        )
        return None
    disk = None
    num_disk_blocks = 0
    if config.kv_offload_disk_path is not None:
        num_disk_blocks = config.kv_offload_disk_bytes // bytes_per_block
        directory = os.path.join(config.kv_offload_disk_path, f"core{config.data_parallel_rank}")
        disk = DiskStore(directory)
    pin_memory = worker.device.type == "cuda" and worker.platform.pin_memory_available
    if worker.device.type == "cuda" and not pin_memory:
        log.warning(
            "kv_offload_pageable",
            reason="pinned memory is unavailable on this platform: the host tier copies "
            "from pageable memory, which blocks each copy",
        )
    pool = attach_host_pool(
        worker, worker.kv_caches, num_host_slots, pin_memory=pin_memory, disk=disk
    )
    bytes_per_slot = pool.bytes_per_slot  # the same as the pool's, every layer's K and V
    offload = KVOffload(num_host_slots, config.block_size, bytes_per_slot, disk, num_disk_blocks)
    description = _describe(num_host_slots, bytes_per_slot, pool.pinned, disk, num_disk_blocks)
    log.info("kv_offload_tiers", tiers=description)
    return OffloadTiers(offload, description, pool.loads_done_through)


def _describe(
    num_host_slots: int,
    bytes_per_block: int,
    pinned: bool,
    disk: DiskStore | None,
    num_disk_blocks: int,
) -> str:
    memory = "pinned" if pinned else "pageable"
    text = f"cpu {num_host_slots} blocks ({_gib(num_host_slots * bytes_per_block)} GiB, {memory})"
    if disk is not None:
        text += (
            f"; disk {num_disk_blocks} blocks ({_gib(num_disk_blocks * bytes_per_block)} GiB "
            f"in {disk.directory})"
        )
    return text


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f}"
