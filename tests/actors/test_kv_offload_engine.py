"""The offload tiers through the engine core on the embedded model (CPU, float32): the
device pool holds 8 blocks, so a long unrelated prompt between two turns of a chat evicts
turn 1's blocks. Without tiers turn 2 recomputes them; with the host tier (and with a disk
tier behind a one-block host tier) it copies them back, and its greedy answer is the same
token for token: alone (it runs in the step that loads it), beside a running request (it
is held a step while the loads overlap that request's step), three copies at once (one
load, shared, in a pool too small for all of them), and behind a slow disk read (the other
request keeps stepping meanwhile). Another cache_salt finds nothing of them."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.core.engine_startup import reuse_engine
from actors.inprocess_engine import InProcessEngine
from actors.protocol.config import EngineConfig
from actors.protocol.messages import EngineRequest, KVTierStats
from actors.protocol.sampling_params import SamplingParams
from app.tokenizer_loader import load_tokenizer
from gpu.kv_disk_store import DiskStore
from tests.app._server_fixtures import ENGINE, shared_model

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 8
CONFIG = ENGINE.replace(max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=NUM_KV_BLOCKS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
FLUSH = SamplingParams(temperature=0.0, max_tokens=1)
ALONGSIDE = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
"""A request that runs while turn 2 is admitted."""
TEXT = "The committee met on Tuesday to review the budget and the new library wing."


@functools.cache
def _prompts() -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Turn 1's prompt, the text after turn 1's answer in turn 2, a flush prompt that needs
    the whole pool, and the EOS ids."""
    tokenizer = load_tokenizer(CONFIG.model)
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat: {TEXT}"}], add_generation_prompt=True
    )
    follow_up = "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    flush_len = NUM_KV_BLOCKS * CONFIG.block_size - 1  # + its one output: every block
    return (
        tuple(tokenizer.encode(first)),
        tuple(tokenizer.encode(follow_up, False)),
        tuple(range(1000, 1000 + flush_len)),
        tuple(tokenizer.eos_token_ids),
    )


async def _generate(
    engine: InProcessEngine,
    request_id: str,
    prompt: tuple[int, ...],
    params: SamplingParams = GREEDY,
    cache_salt: str | None = None,
) -> tuple[tuple[int, ...], int]:
    stream = engine.add_request(
        EngineRequest(
            request_id,
            prompt,
            params,
            time.monotonic(),
            eos_token_ids=_prompts()[3],
            cache_salt=cache_salt,
        )
    )
    with anyio.fail_after(300):
        final = await stream.wait_finished()
    assert final is not None and final.finish_reason in ("stop", "length"), final
    return final.token_ids, final.num_cached_tokens


def _turns(
    config: EngineConfig,
    turn_2_salt: str | None = None,
    num_flushes: int = 1,
    alongside: bool = False,
    num_turn_2: int = 1,
    step_observers: tuple[Any, ...] = (),
) -> tuple[tuple[int, ...], int, tuple[KVTierStats, ...]]:
    """(turn 2's answer, turn 2's cached tokens, the tiers' stats) of turn 1, flushes that
    evict it from the device pool (a second one from a small host tier too), then turn 2
    (`num_turn_2` copies, which must agree), with `alongside` while another request runs."""
    loaded = reuse_engine(shared_model(), config)
    prompt_1, follow_up, flush, _ = _prompts()

    async def run() -> tuple[tuple[int, ...], int, tuple[KVTierStats, ...]]:
        engine = InProcessEngine(
            loaded.worker, loaded.runner, config, step_observers=step_observers
        )
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            answer_1, _ = await _generate(engine, "turn-1", prompt_1)
            for index in range(num_flushes):
                flush_prompt = tuple(token + 2000 * index for token in flush)
                await _generate(engine, f"flush-{index}", flush_prompt, FLUSH)
            if alongside:
                other = engine.add_request(
                    EngineRequest("other", tuple(range(3000, 3010)), ALONGSIDE, time.monotonic())
                )
                assert await other.get() is not None  # running: it has a token
            prompt_2 = prompt_1 + answer_1 + follow_up
            turns_2 = []
            async with anyio.create_task_group() as turns:

                async def turn_2(index: int) -> None:
                    turns_2.append(
                        await _generate(engine, f"turn-2-{index}", prompt_2, cache_salt=turn_2_salt)
                    )

                for index in range(num_turn_2):
                    turns.start_soon(turn_2, index)
            if alongside:
                with anyio.fail_after(300):
                    await other.wait_finished()
            assert len({answer for answer, _ in turns_2}) == 1, turns_2
            kv = engine.core.scheduler.kv
            engine.core.scheduler.free_finished_blocks()
            kv.check_invariants()
            assert kv.stats().num_used_blocks == 0
            tiers = kv.stats().kv_tiers
            engine.stop()
        return turns_2[0][0], max(num_cached for _, num_cached in turns_2), tiers

    return anyio.run(run)


@functools.cache
def _without_tiers() -> tuple[tuple[int, ...], int, tuple[KVTierStats, ...]]:
    return _turns(CONFIG.replace(runner="v2"))


def test_the_flush_evicts_turn_one_from_the_device_pool() -> None:
    """Else the tests below would prove nothing."""
    _, num_cached, tiers = _without_tiers()
    assert num_cached == 0 and tiers == ()


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_host_tier_brings_turn_one_back_with_the_same_answer(runner: str) -> None:
    answer, num_cached, tiers = _turns(CONFIG.replace(runner=runner, kv_offload_cpu_bytes=64 << 20))
    prompt_1 = _prompts()[0]
    assert num_cached >= (len(prompt_1) // CONFIG.block_size) * CONFIG.block_size
    (cpu,) = tiers
    assert cpu.tier == "cpu" and cpu.hits_tokens == num_cached and cpu.loaded_bytes > 0
    assert answer == _without_tiers()[0]


def test_disk_tier_behind_a_small_host_tier(tmp_path: Path) -> None:
    """Host memory for 4 blocks: the second flush pushes turn 1 on to disk."""
    bytes_per_block = shared_model().worker.kv_spec.bytes_per_block
    answer, num_cached, tiers = _turns(
        CONFIG.replace(
            runner="v2",
            kv_offload_cpu_bytes=4 * bytes_per_block,
            kv_offload_disk_path=str(tmp_path),
            kv_offload_disk_bytes=64 << 20,
        ),
        num_flushes=2,
    )
    prompt_1 = _prompts()[0]
    assert num_cached >= (len(prompt_1) // CONFIG.block_size) * CONFIG.block_size
    cpu, disk = tiers
    assert disk.tier == "disk" and disk.hits_tokens == num_cached and disk.saved_bytes > 0
    assert answer == _without_tiers()[0]


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_host_hits_beside_a_running_request_give_the_same_answer(runner: str) -> None:
    """Three copies of turn 2 while another request runs: held a step, one load shared;
    the pool of 8 blocks cannot run them all at once (they wait or are preempted)."""
    answer, num_cached, tiers = _turns(
        CONFIG.replace(runner=runner, kv_offload_cpu_bytes=64 << 20), alongside=True, num_turn_2=3
    )
    assert num_cached >= (len(_prompts()[0]) // CONFIG.block_size) * CONFIG.block_size
    assert tiers[0].hits_tokens >= num_cached
    assert answer == _without_tiers()[0]


def test_a_slow_disk_read_never_stops_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block read from disk takes 0.3 s on the reader thread; the running request's
    steps go on meanwhile, and turn 2's answer is the same."""
    read_windows: list[tuple[float, float]] = []
    step_times: list[float] = []
    plain_read = DiskStore.read

    def slow_read(store: DiskStore, block_hash: bytes) -> bytes | None:
        assert threading.current_thread() is not threading.main_thread()
        started = time.monotonic()
        time.sleep(0.3)
        read_windows.append((started, time.monotonic()))
        return plain_read(store, block_hash)

    monkeypatch.setattr(DiskStore, "read", slow_read)
    bytes_per_block = shared_model().worker.kv_spec.bytes_per_block
    answer, num_cached, tiers = _turns(
        CONFIG.replace(
            runner="v2",
            kv_offload_cpu_bytes=4 * bytes_per_block,
            kv_offload_disk_path=str(tmp_path),
            kv_offload_disk_bytes=64 << 20,
        ),
        num_flushes=2,
        alongside=True,
        step_observers=(lambda _: step_times.append(time.monotonic()),),
    )
    assert read_windows and num_cached > 0 and tiers[1].hits_tokens > 0
    first_start, last_end = read_windows[0][0], read_windows[-1][1]
    assert sum(first_start < t < last_end for t in step_times) >= 3
    assert answer == _without_tiers()[0]


def test_another_salt_gets_nothing_from_the_host_tier() -> None:
    answer, num_cached, tiers = _turns(
        CONFIG.replace(runner="v2", kv_offload_cpu_bytes=64 << 20), turn_2_salt="other"
    )
    assert num_cached == 0 and tiers[0].hits_tokens == 0
    assert answer == _without_tiers()[0]
