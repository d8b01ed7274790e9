"""Random multi-turn workloads on a device pool too small to keep the conversations, with the
host tier (and a disk tier) behind it, through the real scheduler and a fake device that
runs each step's KVTransfer on simulated host slots and disk files, in order, as the worker
does: its loads land one to four steps later (the worker overlaps them with as many
forwards), or when a step waits for them (`wait_loads_through`). The fake device checks
that every position a step attends to holds its token: so every block loaded back from a
tier holds the right KV, no step reads or writes a block whose load is still in flight,
under two steps in flight, preemption and finishing requests; and the prefix cache's query
and hit totals never go down. Disk reads end a random number of steps after they start,
while the other requests run."""

from __future__ import annotations

import random

import pytest

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.kv_offload import KVOffload
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from tests.actors._kv_helpers import engine_request
from tests.actors._kv_offload_fakes import TOKEN_BYTES, FakeDisk, OffloadFakeRunner

BLOCK_SIZE = 4


def _run(
    seed: int, max_steps_in_flight: int, with_disk: bool
) -> tuple[KVCacheManager, OffloadFakeRunner]:
    rng = random.Random(seed)
    disk = FakeDisk(hold_reads=True) if with_disk else None
    num_host_slots = 6 if with_disk else 24
    offload = KVOffload(
        num_host_slots, BLOCK_SIZE, BLOCK_SIZE * TOKEN_BYTES, disk, 64 if with_disk else 0
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
        block_size=BLOCK_SIZE,
        max_num_seqs=3,
        manager=manager,
        rng=rng,
        disk=disk,
        load_delay_steps=rng.choice([1, 2, 4]),
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
    counted = (0, 0)
    while current:
        while (out := scheduler.schedule()) is not None:
            runner.execute(out)
            usage = manager.stats()  # the totals feed Prometheus counters: never down
            now = (usage.prefix_cache_queries_tokens, usage.prefix_cache_hits_tokens)
            assert now[0] >= counted[0] and now[1] >= counted[1], (counted, now)
            counted = now
        if runner.pending_updates:
            runner.deliver_oldest(scheduler)
        if disk is not None and (rng.random() < 0.3 or not runner.pending_updates):
            disk.end_reads()
        for conversation, request_id in list(current.items()):
            if request_id in runner.finished:
                del current[conversation]
                histories[conversation] += runner.outputs[request_id]
                turns[conversation] += 1
                if turns[conversation] < 4 and len(histories[conversation]) < 30:
                    start_turn(conversation)
        manager.check_invariants()
    return manager, runner


@pytest.mark.parametrize("with_disk", [False, True], ids=["host", "host+disk"])
@pytest.mark.parametrize("max_steps_in_flight", [1, 2])
def test_blocks_loaded_from_the_tiers_hold_the_right_kv(
    max_steps_in_flight: int, with_disk: bool
) -> None:
    hits_tokens = {"cpu": 0, "disk": 0}
    num_overlapped_loads = num_long_loads = 0
    for seed in range(12):
        manager, runner = _run(seed, max_steps_in_flight, with_disk)
        for tier in manager.stats().kv_tiers:
            hits_tokens[tier.tier] += tier.hits_tokens
        num_overlapped_loads += sum(
            1
            for t in runner.transfers
            if t is not None and t.load_host_slots and t.wait_loads_through < t.load_id
        )
        num_long_loads += runner.load_delay_steps > 1 and num_overlapped_loads > 0
    # the workloads do come back from the tiers, with loads beside other rows, some of them
    # outlasting a step (else the checks above prove nothing)
    assert hits_tokens["cpu"] > 0 and num_overlapped_loads > 0 and num_long_loads > 0
    assert (hits_tokens["disk"] > 0) == with_disk
