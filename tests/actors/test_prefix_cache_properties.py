"""Property tests: conversations (each turn's prompt is an earlier request's prompt + outputs +
new tokens) through the scheduler on fake devices, with and without speculation, one or two
steps in flight, preemptions and aborts. The fakes check that every KV position a step
attends to holds its token, so a prefix-cache hit on a block published too early (a token
whose KV was not written yet, a rejected draft's KV) fails; and every cached block must hold
exactly the tokens its hash names."""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.prefix_hash import BlockHash, hash_full_blocks
from actors.core.request import Request
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from tests.actors._kv_helpers import FakeRunner, engine_request
from tests.actors._spec_fake_runner import SpecFakeRunner

MAX_MODEL_LEN = 40


def _check_cached_blocks(
    manager: KVCacheManager,
    kv_cache: dict[int, list[int | None]],
    requests: list[tuple[Request, str | None]],
) -> None:
    """Every cached block's hash is that of a full block of some request's known tokens,
    and the fake device's KV in that block holds exactly those tokens."""
    block_size = manager.block_size
    expected: dict[BlockHash, list[int]] = {}
    for request, salt in requests:
        tokens = request.all_token_ids
        for index, block_hash in enumerate(hash_full_blocks(tokens, block_size, salt)):
            expected[block_hash] = list(tokens[index * block_size : (index + 1) * block_size])
    for block_id in range(manager.pool.num_blocks):
        block_hash = manager.pool.block_hash(block_id)
        if block_hash is None:
            continue
        assert block_hash in expected, f"block {block_id} is cached under a hash of no tokens"
        assert kv_cache.get(block_id) == expected[block_hash], (
            f"cached block {block_id} holds KV {kv_cache.get(block_id)}, "
            f"expected {expected[block_hash]}"
        )


def _next_prompt(
    rng: random.Random, requests: list[tuple[Request, str | None]]
) -> tuple[list[int], str | None]:
    """Mostly a next turn: an earlier request's tokens so far plus a few new ones."""
    finished = [(r, salt) for r, salt in requests if r.num_output_tokens > 0]
    if finished and rng.random() < 0.8:
        parent, salt = rng.choice(finished)
        new_tokens = [rng.randrange(5) for _ in range(rng.randint(1, 4))]
        prompt = list(parent.all_token_ids) + new_tokens
        return prompt[: MAX_MODEL_LEN - 2], salt if rng.random() < 0.9 else "other"
    return [rng.randrange(5) for _ in range(rng.randint(1, 12))], rng.choice([None, "s"])


def _run_conversations(
    rng: random.Random,
    scheduler: Scheduler,
    runner: FakeRunner | SpecFakeRunner,
    num_requests: int,
    abort_probability: float,
) -> Callable[[], None]:
    requests: list[tuple[Request, str | None]] = []

    def check() -> None:
        scheduler.kv.check_invariants()
        _check_cached_blocks(scheduler.kv, runner.kv_cache, requests)

    for iteration in range(5000):
        if len(requests) < num_requests and rng.random() < 0.3:
            prompt, salt = _next_prompt(rng, requests)
            max_tokens = rng.randint(1, 12)
            request_id = f"r{len(requests)}"
            scheduler.add_request(
                engine_request(request_id, prompt, max_tokens=max_tokens, cache_salt=salt)
            )
            request = scheduler.get_request(request_id)
            assert request is not None
            requests.append((request, salt))
            runner.register(request_id, min(max_tokens, MAX_MODEL_LEN - len(prompt)))
        unfinished = [r.request_id for r in scheduler.unfinished_requests()]
        if unfinished and rng.random() < abort_probability:
            victim = rng.choice(unfinished)
            scheduler.abort_requests([victim])
            runner.abort([victim])
        while (out := scheduler.schedule()) is not None:
            runner.execute(out)
            check()
        if runner.pending_updates:
            runner.deliver_oldest(scheduler)
            check()
        idle = not scheduler.has_unfinished_requests and not runner.pending_updates
        if len(requests) == num_requests and idle:
            return check
    raise AssertionError("the workload did not finish")


def _config(rng: random.Random, block_size: int, max_steps_in_flight: int, k: int):
    return SchedulerConfig(
        max_num_seqs=3,
        max_num_batched_tokens=rng.randint(4, 40),
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        max_steps_in_flight=max_steps_in_flight,
        num_speculative_tokens=k,
    )


@settings(deadline=None, max_examples=150)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 10),
    max_steps_in_flight=st.sampled_from([1, 2]),
    num_requests=st.integers(2, 10),
    abort_probability=st.sampled_from([0.0, 0.05]),
)
def test_conversations_hit_only_blocks_whose_kv_is_written(
    seed: int,
    block_size: int,
    extra_blocks: int,
    max_steps_in_flight: int,
    num_requests: int,
    abort_probability: float,
) -> None:
    rng = random.Random(seed)
    config = _config(rng, block_size, max_steps_in_flight, k=0)
    num_blocks = -(-MAX_MODEL_LEN // block_size) + extra_blocks
    manager = KVCacheManager(num_blocks, block_size)
    scheduler = Scheduler(config, manager)
    runner = FakeRunner(block_size=block_size, max_num_seqs=3, manager=manager, rng=rng)
    _run_conversations(rng, scheduler, runner, num_requests, abort_probability)()


@settings(deadline=None, max_examples=150)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 4),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 10),
    max_steps_in_flight=st.sampled_from([1, 2]),
    num_requests=st.integers(2, 10),
    abort_probability=st.sampled_from([0.0, 0.05]),
)
def test_speculative_conversations_never_cache_a_rejected_draft(
    seed: int,
    k: int,
    block_size: int,
    extra_blocks: int,
    max_steps_in_flight: int,
    num_requests: int,
    abort_probability: float,
) -> None:
    rng = random.Random(seed)
    config = _config(rng, block_size, max_steps_in_flight, k)
    num_blocks = -(-MAX_MODEL_LEN // block_size) + extra_blocks
    manager = KVCacheManager(num_blocks, block_size)
    scheduler = Scheduler(config, manager)
    # A small vocabulary: drafts are often accepted, so blocks fill with accepted drafts.
    runner = SpecFakeRunner(block_size, manager, rng, vocab_size=rng.choice([2, 5]))
    _run_conversations(rng, scheduler, runner, num_requests, abort_probability)()


def _conversation_hits(seed: int, publish_decoded_blocks: bool) -> int:
    rng = random.Random(seed)
    manager = KVCacheManager(64, 2)
    if not publish_decoded_blocks:  # what the cache held before decoded blocks joined it
        manager.cache_blocks = lambda *args: None  # type: ignore[method-assign]
    scheduler = Scheduler(_config(rng, 2, 2, k=0), manager)
    runner = FakeRunner(block_size=2, max_num_seqs=3, manager=manager, rng=rng)
    _run_conversations(rng, scheduler, runner, 10, 0.0)
    return manager.stats().prefix_cache_hits_tokens


def test_conversation_workloads_do_hit_decoded_blocks() -> None:
    """The property tests above are only as strong as their hits: the same workloads hit
    more tokens once decoded blocks are published."""
    for seed in range(3):
        assert _conversation_hits(seed, True) > _conversation_hits(seed, False)
