"""Random multi-turn workloads on a device pool too small to keep the conversations, with the
host tier (and a disk tier) behind it, through the real scheduler and a fake device that
runs each step's KVTransfer on simulated host slots and disk files before the step, in
order, as the worker does. The fake device checks that every position a step attends to
holds its token: so every block loaded back from a tier holds the right KV, under two steps
in flight, preemption and finishing requests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.kv_offload import KVOffload
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.messages import KVTransfer, SchedulerOutput
from tests.actors._kv_helpers import FakeRunner, engine_request

BLOCK_SIZE = 4
_TOKEN_BYTES = 4
_UNWRITTEN = 0xFFFFFFFF


def _encode(block: list[int | None]) -> bytes:
    return b"".join(
        (_UNWRITTEN if t is None else t).to_bytes(_TOKEN_BYTES, "little") for t in block
    )


def _decode(data: bytes) -> list[int | None]:
    tokens = [
        int.from_bytes(data[i : i + _TOKEN_BYTES], "little")
        for i in range(0, len(data), _TOKEN_BYTES)
    ]
    return [None if t == _UNWRITTEN else t for t in tokens]


@dataclass
class FakeDisk:
    files: dict[bytes, bytes] = field(default_factory=dict)

    def write(self, block_hash: bytes, data: bytes) -> None:
        self.files[block_hash] = data

    def read(self, block_hash: bytes) -> bytes | None:
        return self.files.get(block_hash)

    def delete(self, block_hash: bytes) -> None:
        self.files.pop(block_hash, None)

    def clear(self) -> None:
        self.files.clear()


@dataclass
class OffloadFakeRunner(FakeRunner):
    """FakeRunner whose device also runs each step's offload copies first."""

    disk: FakeDisk | None = None
    host_slots: dict[int, list[int | None]] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> None:
        if out.kv_transfer is not None:
            self._copy(out.kv_transfer)
        super().execute(out)

    def _copy(self, transfer: KVTransfer) -> None:
        empty = [None] * self.block_size
        for slot, block_hash in zip(transfer.spill_host_slots, transfer.spill_hashes, strict=True):
            assert self.disk is not None
            self.disk.write(block_hash, _encode(self.host_slots[slot]))
        for block_id, slot in zip(
            transfer.save_gpu_block_ids, transfer.save_host_slots, strict=True
        ):
            self.host_slots[slot] = list(self.kv_cache.get(block_id, empty))
        for slot, data in zip(transfer.fill_host_slots, transfer.fill_data, strict=True):
            self.host_slots[slot] = _decode(data)
        for slot, block_id in zip(
            transfer.load_host_slots, transfer.load_gpu_block_ids, strict=True
        ):
            self.kv_cache[block_id] = list(self.host_slots[slot])


def _run(seed: int, max_steps_in_flight: int, with_disk: bool) -> KVCacheManager:
    rng = random.Random(seed)
    disk = FakeDisk() if with_disk else None
    num_host_slots = 6 if with_disk else 24
    offload = KVOffload(
        num_host_slots, BLOCK_SIZE, BLOCK_SIZE * _TOKEN_BYTES, disk, 64 if with_disk else 0
    )
    manager = KVCacheManager(12, BLOCK_SIZE, offload=offload)
    config = SchedulerConfig(
        max_num_seqs=3,
        max_num_batched_tokens=rng.choice([6, 16, 64]),
        max_model_len=48,
        block_size=BLOCK_SIZE,
        max_steps_in_flight=max_steps_in_flight,
    )
    scheduler = Scheduler(config, manager)
    runner = OffloadFakeRunner(
        block_size=BLOCK_SIZE, max_num_seqs=3, manager=manager, rng=rng, disk=disk
    )
    system = [rng.randrange(50) for _ in range(rng.randrange(3, 10))]
    histories = {f"c{i}": list(system) for i in range(5)}
    turns = dict.fromkeys(histories, 0)
    current: dict[str, str] = {}

    def start_turn(conversation: str) -> None:
        history = histories[conversation]
        history += [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        request_id = f"{conversation}-t{turns[conversation]}"
        max_tokens = rng.randrange(1, 8)
        scheduler.add_request(engine_request(request_id, history, max_tokens=max_tokens))
        runner.register(request_id, max_tokens)
        current[conversation] = request_id

    for conversation in histories:
        start_turn(conversation)
    while current:
        while (out := scheduler.schedule()) is not None:
            runner.execute(out)
        if runner.pending_updates:
            runner.deliver_oldest(scheduler)
        for conversation, request_id in list(current.items()):
            if request_id in runner.finished:
                del current[conversation]
                histories[conversation] += runner.outputs[request_id]
                turns[conversation] += 1
                if turns[conversation] < 4 and len(histories[conversation]) < 30:
                    start_turn(conversation)
        manager.check_invariants()
    return manager


@pytest.mark.parametrize("with_disk", [False, True], ids=["host", "host+disk"])
@pytest.mark.parametrize("max_steps_in_flight", [1, 2])
def test_blocks_loaded_from_the_tiers_hold_the_right_kv(
    max_steps_in_flight: int, with_disk: bool
) -> None:
    hits_tokens = {"cpu": 0, "disk": 0}
    for seed in range(12):
        for tier in _run(seed, max_steps_in_flight, with_disk).stats().kv_tiers:
            hits_tokens[tier.tier] += tier.hits_tokens
    # the workloads do come back from the tiers (else the checks above prove nothing)
    assert hits_tokens["cpu"] > 0
    assert (hits_tokens["disk"] > 0) == with_disk
