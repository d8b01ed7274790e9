"""The worker's half of the prefix cache's offload tiers: a pool of host slots, one KV block
of every layer each, and the copies the engine core orders in a step's KVTransfer.

A slot holds one block of all layers, K and V, as bytes: [num_layers, 2, block_size,
num_kv_heads, head_dim * element size] uint8, so any KV dtype (fp8 too) copies and spills
alike. Host memory is pinned where the platform allows it, pageable otherwise (the copies
then block; WSL2 without forced pinning).

On CUDA the copies run on a side stream that first waits for the work already queued on
the compute stream (so a save reads a block after every step that wrote it, and a load
writes a block after every step that read its old contents). The step's forward waits for
the saves' reads only (a gather into a device staging buffer), since the blocks they read
are reused at once; their copies to the host, and the loads, overlap it and as
many later steps as they take: a long prefix comes back over PCIe in more time than a decode
step takes, and making the next step wait for it stalled every running request. No row
reads or rewrites a loaded block until the engine core knows the load is done, from
`loads_done_through` (read with each step's outputs: an event query, no wait), or has told a
step to wait for it (KVTransfer.wait_loads_through, which also orders the other ranks of a
tensor-parallel group after loads rank 0 finished). Spills and fills touch slots on the CPU,
so they first wait for the side stream's earlier copies. On the CPU every copy is a plain
tensor copy, done before `apply` returns.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog
import torch

from actors.protocol.messages import KVTransfer

log = structlog.get_logger("tandem.kv_offload")

_MAX_BLOCKS_PER_COPY = 32
"""Blocks gathered into one device staging buffer (bounds its memory)."""


class DiskWriter(Protocol):
    def write(self, block_hash: bytes, data: bytes) -> None: ...


class HostKVPool:
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        num_slots: int,
        *,
        pin_memory: bool,
        disk: DiskWriter | None = None,
    ) -> None:
        """`kv_caches`: the worker's [2, num_blocks, block_size, num_kv_heads, head_dim]
        tensor per layer."""
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self._layers_u8 = [_as_bytes(layer) for layer in kv_caches]
        self.device = kv_caches[0].device
        first = self._layers_u8[0]  # [2, num_blocks, block_size, heads, head_bytes]
        self.slot_shape = (len(kv_caches), 2, *first.shape[2:])
        self.num_slots = num_slots
        self.disk = disk
        self.slots_cpu, self.pinned = _host_slots((num_slots, *self.slot_shape), pin_memory)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._last_copy: torch.cuda.Event | None = None
        self._loads_in_flight: deque[tuple[int, torch.cuda.Event]] = deque()
        """(load id, its end on the side stream), oldest first, not yet seen done."""
        self._done_through = -1
        self._loads_lock = threading.Lock()
        """The step thread queues loads; the thread that reads step outputs asks about them."""

    @property
    def bytes_per_slot(self) -> int:
        return self.slots_cpu[0].numel()

    def start_over(self) -> None:
        """For a new engine core, whose load ids start from 0: the earlier one's copies
        end first."""
        self._wait_for_copies()
        with self._loads_lock:
            self._loads_in_flight.clear()
            self._done_through = -1

    def loads_done_through(self) -> int:
        """The newest load id whose copies are done, every earlier one too (-1: none)."""
        with self._loads_lock:
            while self._loads_in_flight and self._loads_in_flight[0][1].query():
                self._done_through = self._loads_in_flight.popleft()[0]
            return self._done_through

    @torch.inference_mode()
    def apply(self, transfer: KVTransfer | None) -> None:
        """Start a step's copies (None: none), before its forward is queued: the forward
        comes after this step's saves and the loads `wait_loads_through` names."""
        if transfer is None:
            return
        if transfer.spill_host_slots or transfer.fill_host_slots:
            self._wait_for_copies()
            self._spill(transfer.spill_host_slots, transfer.spill_hashes)
        if self._stream is None:
            self._copy_now(transfer)
            return
        compute = torch.cuda.current_stream(self.device)
        if transfer.save_host_slots or transfer.fill_host_slots or transfer.load_host_slots:
            self._copy_beside(transfer, compute)
        with self._loads_lock:
            for load_id, done in self._loads_in_flight:
                if load_id <= transfer.wait_loads_through:
                    compute.wait_event(done)

    def slot_bytes(self, host_slot: int) -> bytes:
        """A slot's bytes (for tests and spills); waits for copies into it."""
        self._wait_for_copies()
        return self.slots_cpu[host_slot].numpy().tobytes()

    # ---- the copies -----------------------------------------------------------------

    def _copy_now(self, transfer: KVTransfer) -> None:
        self._save(transfer.save_gpu_block_ids, transfer.save_host_slots)
        self._fill(transfer.fill_host_slots, transfer.fill_data)
        self._load(transfer.load_host_slots, transfer.load_gpu_block_ids)
        if transfer.load_host_slots:
            with self._loads_lock:
                self._done_through = transfer.load_id

    def _copy_beside(self, transfer: KVTransfer, compute: torch.cuda.Stream) -> None:
        """Queue the copies on the side stream; the compute stream waits for the saves."""
        assert self._stream is not None
        self._stream.wait_stream(compute)
        # The step's slots are distinct (the engine core pins them), so the CPU's fills
        # race with none of its saves; the earlier steps' copies are done (apply).
        self._fill(transfer.fill_host_slots, transfer.fill_data)
        saves_read, loads_done = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self._save(
                transfer.save_gpu_block_ids,
                transfer.save_host_slots,
                on_read=lambda: saves_read.record(self._stream),
            )
            self._load(transfer.load_host_slots, transfer.load_gpu_block_ids)
            loads_done.record(self._stream)
        self._last_copy = loads_done
        compute.wait_event(saves_read)
        if transfer.load_host_slots:
            with self._loads_lock:
                self._loads_in_flight.append((transfer.load_id, loads_done))

    def _save(
        self,
        block_ids: Sequence[int],
        host_slots: Sequence[int],
        on_read: Callable[[], None] = lambda: None,
    ) -> None:
        """Gather the blocks into a device staging buffer, a chunk at a time, and copy it to
        the slots. `on_read` runs once the last chunk is gathered, before its copy over PCIe:
        from there on the blocks may be rewritten, so the step's forward waits for the
        gathers only and overlaps the slowest part (a step's saves usually fit one chunk)."""
        starts = range(0, len(block_ids), _MAX_BLOCKS_PER_COPY)
        if not starts:
            on_read()
        for start in starts:
            chunk = slice(start, start + _MAX_BLOCKS_PER_COPY)
            index = self._device_index(block_ids[chunk])
            # [n, num_layers, 2, block_size, heads, head_bytes]
            staged = torch.stack([layer[:, index].transpose(0, 1) for layer in self._layers_u8], 1)
            if start == starts[-1]:
                on_read()
            for position, slot in enumerate(host_slots[chunk]):
                self.slots_cpu[slot].copy_(staged[position], non_blocking=self.pinned)

    def _load(self, host_slots: Sequence[int], block_ids: Sequence[int]) -> None:
        for start in range(0, len(block_ids), _MAX_BLOCKS_PER_COPY):
            chunk = slice(start, start + _MAX_BLOCKS_PER_COPY)
            slots = host_slots[chunk]
            staged = torch.empty(
                (len(slots), *self.slot_shape), dtype=torch.uint8, device=self.device
            )
            for position, slot in enumerate(slots):
                staged[position].copy_(self.slots_cpu[slot], non_blocking=self.pinned)
            index = self._device_index(block_ids[chunk])
            for layer_index, layer in enumerate(self._layers_u8):
                layer[:, index] = staged[:, layer_index].transpose(0, 1)

    def _device_index(self, block_ids: Sequence[int]) -> torch.Tensor:  # [n] int64
        index = torch.tensor(block_ids, dtype=torch.long)
        if self._stream is None or not self.pinned:
            return index.to(self.device)
        # From pageable memory the copy would block this thread (the step loop's) until the
        # side stream's earlier copies are through; from pinned memory (torch's caching host
        # allocator, which keeps the buffer until the copy is done) it is queued like them.
        return index.pin_memory().to(self.device, non_blocking=True)

    def _spill(self, host_slots: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        if self.disk is None:
            return
        for slot, block_hash in zip(host_slots, block_hashes, strict=True):
            self.disk.write(block_hash, self.slots_cpu[slot].numpy().tobytes())

    def _fill(self, host_slots: Sequence[int], data: Sequence[bytes]) -> None:
        for slot, block in zip(host_slots, data, strict=True):
            source = torch.frombuffer(bytearray(block), dtype=torch.uint8)
            self.slots_cpu[slot].view(-1).copy_(source)

    def _wait_for_copies(self) -> None:
        if self._last_copy is not None:
            self._last_copy.synchronize()


def _as_bytes(layer: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, block_size, heads, head_dim] -> the same memory as uint8, the last
    dimension in bytes."""
    return layer.view(torch.uint8)


def _host_slots(shape: tuple[int, ...], pin_memory: bool) -> tuple[torch.Tensor, bool]:
    if pin_memory:
        try:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as exc:
            log.warning(
                "kv_offload_pageable",
                reason=f"pinned host memory failed ({exc}); the host tier copies from "
                "pageable memory, which blocks each copy",
            )
    return torch.empty(shape, dtype=torch.uint8), False


def attach_host_pool(
    worker: object,
    kv_caches: Sequence[torch.Tensor],
    num_slots: int,
    *,
    pin_memory: bool,
    disk: DiskWriter | None,
) -> HostKVPool:
    """The worker's host pool of `num_slots` slots, reused when an earlier engine on the
    same worker made one of that size (tests reuse a loaded model)."""
    pool: HostKVPool | None = getattr(worker, "kv_offload", None)
    if pool is None or pool.num_slots != num_slots:
        pool = HostKVPool(kv_caches, num_slots, pin_memory=pin_memory, disk=disk)
    else:
        if pool.disk is not None and pool.disk is not disk:
            getattr(pool.disk, "close", lambda: None)()  # the earlier engine's writer thread
        pool.start_over()
    pool.disk = disk
    worker.kv_offload = pool  # type: ignore[attr-defined]
    return pool


def kv_loads_done_through(worker: object) -> int:
    """The worker's host pool's `loads_done_through` (-1 without a pool)."""
    pool: HostKVPool | None = getattr(worker, "kv_offload", None)
    return -1 if pool is None else pool.loads_done_through()


def run_kv_transfer(worker: object, transfer: KVTransfer | None) -> None:
    """Start a step's offload copies on the worker's host pool; runners call this for every
    step before its forward."""
    pool: HostKVPool | None = getattr(worker, "kv_offload", None)
    if pool is None:
        if transfer is None:
            return
        raise RuntimeError("the step carries KV offload copies but this worker has no host pool")
    pool.apply(transfer)
