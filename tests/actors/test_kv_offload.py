"""The offload tiers' bookkeeping in the engine core (actors/core/kv_offload.py): the copies
the KV cache manager orders when the device pool evicts a cached block and when a later
prompt hits it in host memory or on disk, salt isolation. Here nothing else runs, so a host
hit is granted in the step that loads it (the holds of a busy engine:
test_kv_offload_holds.py); a disk hit waits for its read first."""

from __future__ import annotations

from concurrent.futures import Future

from actors.core.kv_allocation import AllocateStep, RunningAllocs, WaitingAlloc, WaitingGrant
from actors.core.kv_cache_manager import KVCacheManager
from actors.core.kv_offload import KVOffload
from actors.core.prefix_hash import hash_full_blocks
from actors.protocol.messages import KVTransfer

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 64


class FakeDisk:
    """The disk tier's files in a dict; `corrupt` hashes read back as None (a bad file)."""

    def __init__(self) -> None:
        self.files: dict[bytes, bytes] = {}
        self.corrupt: set[bytes] = set()
        self.deleted: list[bytes] = []

    def write(self, block_hash: bytes, data: bytes) -> None:
        self.files[block_hash] = data

    def read(self, block_hash: bytes) -> bytes | None:
        if block_hash in self.corrupt:
            return None
        return self.files.get(block_hash)

    def read_async(self, block_hash: bytes) -> Future[bytes | None]:
        read: Future[bytes | None] = Future()
        read.set_result(self.read(block_hash))
        return read

    def delete(self, block_hash: bytes) -> None:
        self.deleted.append(block_hash)
        self.files.pop(block_hash, None)

    def clear(self) -> None:
        self.files.clear()


def _manager(
    num_blocks: int = 4, num_host_slots: int = 8, disk: FakeDisk | None = None, num_disk: int = 0
) -> KVCacheManager:
    offload = KVOffload(num_host_slots, BLOCK_SIZE, BYTES_PER_BLOCK, disk, num_disk)
    return KVCacheManager(num_blocks, BLOCK_SIZE, offload=offload)


def _admit(
    manager: KVCacheManager, request_id: str, tokens: range | list[int], salt: str | None = None
) -> tuple[WaitingGrant, KVTransfer | None]:
    """Admit one request (after a step that reads its disk blocks, if it has some), free it
    at once, and return its grant and the step's copies."""
    token_ids = tuple(tokens)
    entry = WaitingAlloc(request_id, token_ids, len(token_ids), 10_000, salt)
    allocation = manager.allocate_step(AllocateStep((), RunningAllocs(), (entry,), 10_000))
    if not allocation.waiting:  # its blocks are read from disk: they are in host memory now
        allocation = manager.allocate_step(AllocateStep((), RunningAllocs(), (entry,), 10_000))
    (grant,) = allocation.waiting
    manager.free([request_id])
    manager.check_invariants()
    return grant, manager.take_transfer()


# ---- the manager's copies -------------------------------------------------------------


def test_evicted_blocks_are_saved_and_a_later_prefix_hit_is_loaded() -> None:
    manager = _manager(num_blocks=4)
    prompt = range(13)  # three full blocks and one token
    first, transfer = _admit(manager, "a", prompt)
    assert transfer is None  # nothing evicted yet
    _, transfer = _admit(manager, "b", range(100, 113))  # needs all 4 blocks: evicts a's
    assert transfer is not None
    assert sorted(transfer.save_gpu_block_ids) == sorted(first.block_ids[:3])
    assert transfer.load_host_slots == ()
    saved = dict(zip(transfer.save_gpu_block_ids, transfer.save_host_slots, strict=True))

    again, transfer = _admit(manager, "c", prompt)
    assert again.num_cached_tokens == 12 and again.num_new_tokens == 1
    assert transfer is not None  # nothing else runs: no hold, the step waits for the loads
    assert transfer.wait_loads_through == transfer.load_id >= 0
    # a's three blocks come back from the slots they were saved to, into c's first blocks
    assert transfer.load_gpu_block_ids == again.block_ids[:3]
    assert transfer.load_host_slots == tuple(saved[b] for b in first.block_ids[:3])
    # b's blocks were evicted by c's allocation and saved, before the loads reuse them
    assert len(transfer.save_gpu_block_ids) == 3
    tiers = manager.stats().kv_tiers
    assert tiers[0].tier == "cpu" and tiers[0].hits_tokens == 12
    assert tiers[0].loaded_bytes == 3 * BYTES_PER_BLOCK
    assert tiers[0].saved_bytes == 6 * BYTES_PER_BLOCK
    # the device pool's own counter is the device's hits only
    assert manager.stats().prefix_cache_hits_tokens == 0


def test_loaded_blocks_are_published_for_the_next_request() -> None:
    manager = _manager(num_blocks=4)
    prompt = range(13)
    _admit(manager, "a", prompt)
    _admit(manager, "b", range(100, 113))
    loaded, _ = _admit(manager, "c", prompt)
    again, transfer = _admit(manager, "d", prompt)
    assert again.block_ids[:3] == loaded.block_ids[:3]  # a device hit now
    assert transfer is None or transfer.load_host_slots == ()


def test_a_different_cache_salt_never_hits_another_salts_offloaded_blocks() -> None:
    manager = _manager(num_blocks=4)
    prompt = range(13)
    _admit(manager, "a", prompt, salt="alice")
    _admit(manager, "b", range(100, 113))
    other, _ = _admit(manager, "c", prompt, salt="bob")
    assert other.num_cached_tokens == 0
    same, _ = _admit(manager, "d", prompt, salt="alice")
    assert same.num_cached_tokens == 12


def test_slots_a_step_loads_from_are_not_reused_by_its_saves() -> None:
    manager = _manager(num_blocks=4, num_host_slots=3)
    prompt = range(13)
    _admit(manager, "a", prompt)
    _, transfer = _admit(manager, "b", range(100, 113))  # a's 3 blocks fill the 3 slots
    assert transfer is not None and len(transfer.save_host_slots) == 3
    _, transfer = _admit(manager, "c", prompt)  # loads all 3 slots, evicts b's 3 blocks
    assert transfer is not None
    assert len(transfer.load_host_slots) == 3
    assert not set(transfer.save_host_slots) & set(transfer.load_host_slots)
    assert transfer.save_host_slots == ()  # every slot is pinned by a load: b is dropped


def test_a_hold_the_next_allocation_does_not_grant_is_released_its_blocks_cached() -> None:
    """A running row that cannot grow (a preemption follows) admits no waiting request:
    the held one gives its blocks back at once, loaded and cached for its next try."""
    manager = _manager(num_blocks=8)
    prompt = range(13)
    _admit(manager, "a", prompt)
    _admit(manager, "flush", range(100, 131))  # all 8 blocks: a's go to host memory
    running = WaitingAlloc("r", tuple(range(200, 205)), 5, 10_000)
    manager.allocate_step(AllocateStep((), RunningAllocs(), (running,), 10_000))
    waiting = (WaitingAlloc("d", tuple(prompt), 13, 10_000),)
    held = manager.allocate_step(AllocateStep((), RunningAllocs(("r",), (6,)), waiting, 10_000))
    assert held.waiting == () and manager.has_request("d")
    transfer = manager.take_transfer()
    assert transfer is not None and len(transfer.load_gpu_block_ids) == 3
    assert transfer.wait_loads_through < transfer.load_id  # "r" runs beside the loads
    loaded = transfer.load_gpu_block_ids
    queried_before = manager.stats().prefix_cache_queries_tokens
    too_big = RunningAllocs(("r",), (8 * BLOCK_SIZE + 1,))
    failed = manager.allocate_step(AllocateStep((), too_big, waiting, 10_000))
    assert failed.num_running_ok == 0 and not manager.has_request("d")
    manager.check_invariants()
    manager.free(["r"])
    # A hold counts its lookups only when granted (the totals feed monotonic counters):
    # the released one counted nothing, and d's granted admission counts its prompt once.
    assert manager.stats().prefix_cache_queries_tokens == queried_before
    again, transfer = _admit(manager, "d", prompt)
    assert manager.stats().prefix_cache_queries_tokens == queried_before + 13
    assert again.num_cached_tokens == 12 and again.block_ids[:3] == loaded
    assert transfer is None or not transfer.load_host_slots  # device hits: no second load


def test_reset_drops_every_offloaded_block() -> None:
    manager = _manager(num_blocks=4)
    _admit(manager, "a", range(13))
    _admit(manager, "b", range(100, 113))
    assert manager.reset_offload_tiers() == 3
    grant, _ = _admit(manager, "c", range(13))
    assert grant.num_cached_tokens == 0


# ---- the disk tier --------------------------------------------------------------------


def test_host_evictions_spill_to_disk_and_a_disk_hit_comes_back_through_a_host_slot() -> None:
    disk = FakeDisk()
    manager = _manager(num_blocks=4, num_host_slots=3, disk=disk, num_disk=16)
    prompt = range(13)
    hashes = hash_full_blocks(tuple(prompt), BLOCK_SIZE)[:3]
    _admit(manager, "a", prompt)
    _admit(manager, "b", range(100, 113))  # a -> host
    _, transfer = _admit(manager, "c", range(200, 213))  # b -> host, a -> disk
    assert transfer is not None
    assert sorted(transfer.spill_hashes) == sorted(hashes)
    for block_hash in hashes:  # the worker writes what the slots hold
        disk.write(block_hash, bytes(BYTES_PER_BLOCK))
    grant, transfer = _admit(manager, "d", prompt)
    assert grant.num_cached_tokens == 12
    assert transfer is not None and len(transfer.fill_host_slots) == 3
    assert transfer.load_host_slots == transfer.fill_host_slots
    disk_stats = manager.stats().kv_tiers[1]
    assert disk_stats.tier == "disk" and disk_stats.hits_tokens == 12


def test_a_corrupt_or_missing_disk_block_is_a_miss() -> None:
    disk = FakeDisk()
    manager = _manager(num_blocks=4, num_host_slots=3, disk=disk, num_disk=16)
    prompt = range(13)
    hashes = hash_full_blocks(tuple(prompt), BLOCK_SIZE)[:3]
    _admit(manager, "a", prompt)
    _admit(manager, "b", range(100, 113))
    _admit(manager, "c", range(200, 213))
    disk.write(hashes[0], bytes(BYTES_PER_BLOCK))
    disk.write(hashes[1], bytes(BYTES_PER_BLOCK - 1))  # short: a miss from here on
    disk.corrupt.add(hashes[2])
    grant, _ = _admit(manager, "d", prompt)
    assert grant.num_cached_tokens == 4  # the first block only


def test_the_disk_bound_deletes_least_recently_used_blocks() -> None:
    disk = FakeDisk()
    manager = _manager(num_blocks=4, num_host_slots=3, disk=disk, num_disk=2)
    _admit(manager, "a", range(13))
    _admit(manager, "b", range(100, 113))
    _, transfer = _admit(manager, "c", range(200, 213))
    assert transfer is not None and len(transfer.spill_hashes) == 3
    assert manager.stats().kv_tiers[1].num_blocks == 2
    assert disk.deleted == [transfer.spill_hashes[0]]  # the least recently spilled
