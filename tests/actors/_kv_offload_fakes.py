"""Fakes for the offload tiers' scheduler tests: a disk store in a dict whose reads may be
held back, and a FakeRunner whose device runs each step's KVTransfer on simulated host
slots as the worker does: spills, saves and fills at once, loads landing only when the next
step starts (the worker overlaps them with the step's forward), unless the step reads them
at once (`loads_read_now`). A step that reads or writes a block whose load is still in
flight then fails FakeRunner's attended-KV check."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

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
    loads_in_flight: list[tuple[int, list[int | None]]] = field(default_factory=list)
    transfers: list[KVTransfer | None] = field(default_factory=list)
    """Each executed step's transfer, in step order."""

    def execute(self, out: SchedulerOutput) -> None:
        self._land_loads()
        self.transfers.append(out.kv_transfer)
        if out.kv_transfer is not None:
            self._copy(out.kv_transfer)
            if out.kv_transfer.loads_read_now:
                self._land_loads()
        super().execute(out)

    def _land_loads(self) -> None:
        for block_id, tokens in self.loads_in_flight:
            self.kv_cache[block_id] = tokens
        self.loads_in_flight.clear()

    def _copy(self, transfer: KVTransfer) -> None:
        empty = [None] * self.block_size
        for slot, block_hash in zip(transfer.spill_host_slots, transfer.spill_hashes, strict=True):
            assert self.disk is not None
            self.disk.write(block_hash, encode_block(self.host_slots[slot]))
        for block_id, slot in zip(
            transfer.save_gpu_block_ids, transfer.save_host_slots, strict=True
        ):
            self.host_slots[slot] = list(self.kv_cache.get(block_id, empty))
        for slot, data in zip(transfer.fill_host_slots, transfer.fill_data, strict=True):
            self.host_slots[slot] = _decode(data)
        for slot, block_id in zip(
            transfer.load_host_slots, transfer.load_gpu_block_ids, strict=True
        ):  # the slot is read now: a later step's fills and saves come after the load
            self.loads_in_flight.append((block_id, list(self.host_slots[slot])))
