"""Fakes for the offload tiers' scheduler tests: a disk store in a dict whose reads may be
held back, and a FakeRunner whose device runs each step's KVTransfer on simulated host
slots as the worker does: spills, saves and fills at once, loads landing in order only
`load_delay_steps` steps later (the worker overlaps them with as many forwards), or when a
step waits for them (`wait_loads_through`), and each step's output reporting the newest load
landed. A step that reads a block whose load is still in flight, or writes one (the load
then lands on top of its KV), fails FakeRunner's attended-KV check."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from actors.protocol.messages import KVTransfer, SchedulerOutput
from tests.actors._kv_helpers import FakeRunner

TOKEN_BYTES = 4
_UNWRITTEN = 0xFFFFFFFF


def encode_block(block: list[int | None]) -> bytes:
    return b"".join((_UNWRITTEN if t is None else t).to_bytes(TOKEN_BYTES, "little") for t in block)


def _decode(data: bytes) -> list[int | None]:
    tokens = [
        int.from_bytes(data[i : i + TOKEN_BYTES], "little")
        for i in range(0, len(data), TOKEN_BYTES)
    ]
    return [None if t == _UNWRITTEN else t for t in tokens]


@dataclass
class FakeDisk:
    """Files in a dict. With `hold_reads`, a read ends only at `end_reads` (a slow disk)."""

    files: dict[bytes, bytes] = field(default_factory=dict)
    hold_reads: bool = False
    reads_in_flight: list[tuple[bytes, Future[bytes | None]]] = field(default_factory=list)
    failing: set[bytes] = field(default_factory=set)
    """Hashes whose reads fail (a corrupt file)."""

    def write(self, block_hash: bytes, data: bytes) -> None:
        self.files[block_hash] = data

    def read_async(self, block_hash: bytes) -> Future[bytes | None]:
        read: Future[bytes | None] = Future()
        self.reads_in_flight.append((block_hash, read))
        if not self.hold_reads:
            self.end_reads()
        return read

    def end_reads(self) -> int:
        """End every read in flight; returns how many."""
        reads, self.reads_in_flight = self.reads_in_flight, []
        for block_hash, read in reads:
            read.set_result(None if block_hash in self.failing else self.files.get(block_hash))
        return len(reads)

    def delete(self, block_hash: bytes) -> None:
        self.files.pop(block_hash, None)

    def clear(self) -> None:
        self.files.clear()


@dataclass
class OffloadFakeRunner(FakeRunner):
    """FakeRunner whose device also runs each step's offload copies (module docstring)."""

    disk: FakeDisk | None = None
    host_slots: dict[int, list[int | None]] = field(default_factory=dict)
    load_delay_steps: int = 1
    """Steps a load takes: it lands when the step this many steps after its own starts."""
    loads_in_flight: list[tuple[int, int, list[int | None]]] = field(default_factory=list)
    """(load id, block id, tokens), oldest first."""
    num_steps: int = 0
    load_steps: dict[int, int] = field(default_factory=dict)
    """Load id -> the step that issued it."""
    loads_done_through: int = -1
    transfers: list[KVTransfer | None] = field(default_factory=list)
    """Each executed step's transfer, in step order."""

    def execute(self, out: SchedulerOutput) -> None:
        self.num_steps += 1
        self._land_loads(lambda load_id: self.load_steps[load_id] + self.load_delay_steps)
        self.transfers.append(out.kv_transfer)
        transfer = out.kv_transfer
        if transfer is not None:
            if transfer.load_host_slots:
                self.load_steps[transfer.load_id] = self.num_steps
            self._copy(transfer)
            wait = transfer.wait_loads_through
            self._land_loads(lambda load_id: self.num_steps if load_id <= wait else 1 << 30)
        super().execute(out)
        last = self.pending_updates[-1]
        self.pending_updates[-1] = msgspec.structs.replace(
            last, kv_loads_done_through=self.loads_done_through
        )

    def _land_loads(self, landing_step: Callable[[int], int]) -> None:
        """Land the oldest loads whose landing step has come, in order."""
        in_flight = self.loads_in_flight
        while in_flight and landing_step(in_flight[0][0]) <= self.num_steps:
            load_id, block_id, tokens = in_flight.pop(0)
            self.kv_cache[block_id] = tokens
            self.loads_done_through = load_id

    def _copy(self, transfer: KVTransfer) -> None:
        empty = [None] * self.block_size
        for slot, block_hash in zip(transfer.spill_host_slots, transfer.spill_hashes, strict=True):
            assert self.disk is not None
            self.disk.write(block_hash, encode_block(self.host_slots[slot]))
        saved = set(transfer.save_gpu_block_ids)
        last_loading_saved = max(
            (load_id for load_id, block_id, _ in self.loads_in_flight if block_id in saved),
            default=-1,
        )  # the copies share one stream: a save comes after the loads queued before it
        self._land_loads(
            lambda load_id: self.num_steps if load_id <= last_loading_saved else 1 << 30
        )
        for block_id, slot in zip(
            transfer.save_gpu_block_ids, transfer.save_host_slots, strict=True
        ):
            self.host_slots[slot] = list(self.kv_cache.get(block_id, empty))
        for slot, data in zip(transfer.fill_host_slots, transfer.fill_data, strict=True):
            self.host_slots[slot] = _decode(data)
        for slot, block_id in zip(
            transfer.load_host_slots, transfer.load_gpu_block_ids, strict=True
        ):  # the slot is read now: a later step's fills and saves come after the load
            self.loads_in_flight.append((transfer.load_id, block_id, list(self.host_slots[slot])))
