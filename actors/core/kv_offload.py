"""The prefix cache's offload tiers, as the engine core sees them: which block hashes sit in
host memory (and on disk), and which copies the worker must run.

A block evicted from the device pool (BlockPool's LRU) is saved to a host slot; a prefix
hit in host memory is loaded into a fresh device block, which is published under its hash
at once. The load overlaps the steps after the one that issues it, for as long as it takes:
no row may read the block, nor reuse it, before the worker reports the load done
(`loads_done`, from each step's output) or the step waits for it. So this index knows which
device blocks are still loading (`is_loading`: the KV cache manager holds the requests that
read them, actors/core/kv_holds.py), and a step that must touch one (a reused block, an idle
engine running a held request at once) carries a wait (KVTransfer.wait_loads_through).

With a disk tier, a host slot that must make room is spilled to a file first; a disk hit is
read by the disk store's reader thread (`lookup` starts the reads and answers None
meanwhile: the request waits), and each block read back, its checksum checked, is filled
into a host slot at the next allocation (`poll_reads`), from where it loads as a host hit.
A bad or missing file is a miss. The engine core never waits for the disk.

Slot reuse within one step is what could go wrong: the worker runs all spills, then all
saves, then fills, then loads. So a slot touched by the step's copies is pinned until the
step takes them (`take_transfer`): it is neither evicted nor handed out again before then.
Only published blocks are ever evicted, so only full, correct KV is saved.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from actors.core.prefix_hash import BlockHash
from actors.core.tier_index import TierIndex
from actors.protocol.messages import KVTierStats, KVTransfer

log = structlog.get_logger("tandem.kv_offload")


class DiskBlocks(Protocol):
    """The disk tier's files (gpu/kv_disk_store.py): written and read in the background."""

    def read_async(self, block_hash: BlockHash) -> Future[bytes | None]:
        """The block's bytes, or None when missing, short or corrupt (logged), once read."""
        ...

    def delete(self, block_hash: BlockHash) -> None: ...

    def clear(self) -> None: ...


@dataclass(slots=True)
class _TierCounts:
    queries_tokens: int = 0
    hits_tokens: int = 0
    saved_bytes: int = 0
    loaded_bytes: int = 0


@dataclass(slots=True)
class _PendingTransfer:
    spill_host_slots: list[int] = field(default_factory=list)
    spill_hashes: list[bytes] = field(default_factory=list)
    save_gpu_block_ids: list[int] = field(default_factory=list)
    save_host_slots: list[int] = field(default_factory=list)
    fill_host_slots: list[int] = field(default_factory=list)
    fill_data: list[bytes] = field(default_factory=list)
    load_host_slots: list[int] = field(default_factory=list)
    load_gpu_block_ids: list[int] = field(default_factory=list)
    wait_for_every_load: bool = False
    """A row of the step reads or writes a block still loading: its forward waits."""


@dataclass(slots=True)
class Lookup:
    """One admission's walk through the tiers; its counts are committed only if the
    request is admitted."""

    host_slots: list[int] = field(default_factory=list)
    num_host_queries: int = 0
    num_host_hits: int = 0
    num_disk_queries: int = 0
    num_disk_hits: int = 0


class KVOffload:
    """The host tier (and the disk tier behind it) of one KV cache manager."""

    def __init__(
        self,
        num_host_slots: int,
        block_size: int,
        bytes_per_block: int,
        disk: DiskBlocks | None = None,
        num_disk_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.host = TierIndex(num_host_slots)
        self.disk = disk
        self._disk_index: OrderedDict[BlockHash, None] = OrderedDict()  # least recent first
        self.num_disk_blocks = num_disk_blocks if disk is not None else 0
        self._host_counts = _TierCounts()
        self._disk_counts = _TierCounts()
        self._pending = _PendingTransfer()
        self._loading: dict[int, int] = {}
        """Device blocks whose load may not be done yet -> the load's number."""
        self._next_load_id = 0
        self._waited_through = -1
        """The newest load whose blocks every later step may read (done on rank 0, or
        waited for by the step being built): the next transfer waits for it on every rank."""
        self._sent_wait_through = -1
        """The newest load a transfer already told every rank to wait for."""
        self._reads: dict[BlockHash, Future[bytes | None]] = {}
        """Disk reads in flight, by hash (dropped by a reset: their bytes are not used)."""
        self._from_disk: set[BlockHash] = set()
        """Host blocks filled from disk whose first hit is still to count as a disk hit."""
        self.on_read_done: Callable[[], None] | None = None
        """Called on the reader thread when a disk read ends (the engine loop wakes up)."""

    # ---- the KV cache manager's calls ----------------------------------------------

    def save_evicted(self, evicted: Iterable[tuple[int, BlockHash]]) -> None:
        """Device blocks whose cached KV the pool just evicted: keep a host copy of each."""
        for block_id, block_hash in evicted:
            if block_hash in self.host:
                continue  # the host copy is the same KV
            slot = self._insert_host(block_hash)
            if slot is None:
                continue  # every slot serves this step's copies: the block is dropped
            self._pending.save_gpu_block_ids.append(block_id)
            self._pending.save_host_slots.append(slot)
            self._host_counts.saved_bytes += self.bytes_per_block

    def lookup(self, hashes: Sequence[BlockHash], start_reads: bool = True) -> Lookup | None:
        """The leading blocks of `hashes` (missed by the device pool) that host memory
        holds, their slots pinned; None while some of them are being read from disk (the
        request asks again at a later step). With `start_reads`, reads of the disk's blocks
        among them start here; a request that waited once asks without, so it waits at most
        for the reads in flight, never again for blocks its wait let fall out of host memory."""
        if self._wait_for_reads(hashes, start_reads):
            return None
        lookup = Lookup()
        for block_hash in hashes:
            lookup.num_host_queries += 1
            slot = self.host.lookup(block_hash)
            if slot is None:
                lookup.num_disk_queries += self.disk is not None
                break
            if block_hash in self._from_disk:  # the disk's hit, through a host slot
                self._from_disk.discard(block_hash)
                lookup.num_disk_queries += 1
                lookup.num_disk_hits += 1
            else:
                lookup.num_host_hits += 1
            lookup.host_slots.append(slot)
        return lookup

    def poll_reads(self) -> None:
        """Fill the disk reads that ended into host slots (copied there by the next step);
        a failed read is a miss."""
        for block_hash, read in list(self._reads.items()):
            if not read.done():
                continue
            del self._reads[block_hash]
            data = None if read.exception() is not None else read.result()
            if data is None or len(data) != self.bytes_per_block:
                self._disk_index.pop(block_hash, None)
                if data is not None:
                    log.warning("kv_disk_block_wrong_size", num_bytes=len(data))
                continue
            if block_hash in self.host:
                continue
            slot = self._insert_host(block_hash)
            if slot is None:
                continue  # every slot serves this step's copies: read again later
            if block_hash in self._disk_index:
                self._disk_index.move_to_end(block_hash)
            self._from_disk.add(block_hash)
            self._pending.fill_host_slots.append(slot)
            self._pending.fill_data.append(data)
            self._disk_counts.loaded_bytes += self.bytes_per_block

    def is_loading(self, gpu_block_id: int) -> bool:
        """Whether a load into the device block may still be running: no row may read it."""
        return gpu_block_id in self._loading

    def any_loading(self, gpu_block_ids: Iterable[int]) -> bool:
        return any(block_id in self._loading for block_id in gpu_block_ids)

    def wait_for_loads(self) -> None:
        """A row of the step being built reads blocks still loading (nothing else could run
        beside it): its forward waits for every load."""
        self._pending.wait_for_every_load = True

    def reuse(self, gpu_block_ids: Iterable[int]) -> None:
        """The pool hands out these device blocks for new KV: the step being built waits for
        any load still writing one of them."""
        for block_id in gpu_block_ids:
            if self._loading.pop(block_id, None) is not None:
                self._pending.wait_for_every_load = True

    def loads_done(self, through_load_id: int) -> None:
        """The worker reports every load numbered up to `through_load_id` done on rank 0;
        the next step tells every rank to wait for them (a no-op where they are done)."""
        if through_load_id > self._waited_through:
            self._forget_loads_through(through_load_id)

    def load(self, host_slot: int, gpu_block_id: int) -> None:
        """Copy a host slot (from `lookup`) into a device block, beside the step being
        built and maybe the next ones (their rows must not read the block)."""
        self._pending.load_host_slots.append(host_slot)
        self._pending.load_gpu_block_ids.append(gpu_block_id)
        self._loading[gpu_block_id] = self._next_load_id
        self._host_counts.loaded_bytes += self.bytes_per_block

    def commit(self, lookup: Lookup) -> None:
        """Count an admitted request's lookups."""
        tokens = self.block_size
        self._host_counts.queries_tokens += lookup.num_host_queries * tokens
        self._host_counts.hits_tokens += lookup.num_host_hits * tokens
        self._disk_counts.queries_tokens += lookup.num_disk_queries * tokens
        self._disk_counts.hits_tokens += lookup.num_disk_hits * tokens

    def take_transfer(self) -> KVTransfer | None:
        """The copies decided since the last call, for the step being built; unpins."""
        pending, self._pending = self._pending, _PendingTransfer()
        self.host.release_pins()
        load_id = -1
        if pending.load_host_slots:
            load_id = self._next_load_id
            self._next_load_id += 1
        if pending.wait_for_every_load and self._next_load_id - 1 > self._waited_through:
            self._forget_loads_through(self._next_load_id - 1)
        wait_through = -1
        if self._waited_through > self._sent_wait_through:
            wait_through = self._sent_wait_through = self._waited_through
        transfer = KVTransfer(
            spill_host_slots=tuple(pending.spill_host_slots),
            spill_hashes=tuple(pending.spill_hashes),
            save_gpu_block_ids=tuple(pending.save_gpu_block_ids),
            save_host_slots=tuple(pending.save_host_slots),
            fill_host_slots=tuple(pending.fill_host_slots),
            fill_data=tuple(pending.fill_data),
            load_host_slots=tuple(pending.load_host_slots),
            load_gpu_block_ids=tuple(pending.load_gpu_block_ids),
            load_id=load_id,
            wait_loads_through=wait_through,
        )
        return None if transfer.is_empty else transfer

    def reset(self) -> int:
        """Forget every offloaded block (POST /reset_prefix_cache); returns how many. Copies
        already decided still run: they read or fill slots no index entry points at. Reads
        in flight end unused."""
        num_dropped = self.host.clear() + len(self._disk_index)
        self._disk_index.clear()
        self._reads.clear()
        self._from_disk.clear()
        if self.disk is not None:
            self.disk.clear()
        return num_dropped

    def stats(self) -> tuple[KVTierStats, ...]:
        tiers = [self._tier_stats("cpu", self._host_counts, len(self.host), self.host.num_slots)]
        if self.disk is not None:
            tiers.append(
                self._tier_stats(
                    "disk", self._disk_counts, len(self._disk_index), self.num_disk_blocks
                )
            )
        return tuple(tiers)

    def check_invariants(self) -> None:
        self.host.check_invariants()

    # ---- internals ------------------------------------------------------------------

    def _forget_loads_through(self, load_id: int) -> None:
        """Loads up to `load_id` are done, or the next step waits for them: their blocks
        are readable by every later step."""
        self._waited_through = load_id
        done = [block_id for block_id, number in self._loading.items() if number <= load_id]
        for block_id in done:
            del self._loading[block_id]

    def _spill(self, host_slot: int, block_hash: BlockHash) -> None:
        if self.disk is None or self.num_disk_blocks <= 0:
            return
        self._disk_index.pop(block_hash, None)
        self._disk_index[block_hash] = None
        while len(self._disk_index) > self.num_disk_blocks:
            oldest, _ = self._disk_index.popitem(last=False)
            self.disk.delete(oldest)
        self._pending.spill_host_slots.append(host_slot)
        self._pending.spill_hashes.append(block_hash)
        self._disk_counts.saved_bytes += self.bytes_per_block

    def _wait_for_reads(self, hashes: Sequence[BlockHash], start_reads: bool) -> bool:
        """Whether some of the leading blocks of `hashes` that the tiers hold are being read
        (started here with `start_reads`, as many as host memory has slots)."""
        if self.disk is None:
            return False
        reading = False
        for block_hash in hashes[: self.host.num_slots]:
            if block_hash in self.host:
                self.host.touch(block_hash)  # fills evict other blocks first
                continue
            if block_hash not in self._reads:
                if not start_reads or block_hash not in self._disk_index:
                    break
                try:
                    read = self.disk.read_async(block_hash)
                except RuntimeError:  # the store is closed: the engine is stopping
                    break
                self._reads[block_hash] = read
                read.add_done_callback(self._read_done)
            reading = True
        return reading

    def _read_done(self, _: Future[bytes | None]) -> None:
        if self.on_read_done is not None:
            self.on_read_done()

    def _insert_host(self, block_hash: BlockHash) -> int | None:
        """A pinned host slot for a new block, its previous block spilled; None when every
        slot is pinned."""
        placed = self.host.insert(block_hash)
        if placed is None:
            return None
        slot, evicted = placed
        if evicted is not None:
            self._from_disk.discard(evicted)
            self._spill(slot, evicted)
        return slot

    def _tier_stats(
        self, tier: str, counts: _TierCounts, num_blocks: int, num_capacity_blocks: int
    ) -> KVTierStats:
        return KVTierStats(
            tier,
            counts.queries_tokens,
            counts.hits_tokens,
            counts.saved_bytes,
            counts.loaded_bytes,
            num_blocks,
            num_capacity_blocks,
        )
