"""Blocks completed by decoding join the prefix cache: published exactly when every token in
them is known and their KV is computed (or in a step already built), under the hashes the
same tokens get as a prompt, so a chat's next turn hits its previous answer."""

from __future__ import annotations

import numpy as np
import pytest

from actors.core.kv_allocation import AllocateStep, RunningAllocs, WaitingAlloc
from actors.core.kv_cache_manager import KVCacheManager
from actors.core.prefix_hash import hash_full_blocks
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.messages import SchedulerOutput, StepOutput, StepStats
from tests.actors._kv_helpers import FakeRunner, engine_request

BLOCK_SIZE = 4
PROMPT = tuple(range(100, 106))  # one full block and two tokens


def _scheduler(
    max_steps_in_flight: int,
    *,
    num_blocks: int = 32,
    num_speculative_tokens: int = 0,
    enable_prefix_caching: bool = True,
    cache_outputs: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=BLOCK_SIZE,
        max_steps_in_flight=max_steps_in_flight,
        num_speculative_tokens=num_speculative_tokens,
    )
    kv = KVCacheManager(
        num_blocks,
        BLOCK_SIZE,
        enable_prefix_caching=enable_prefix_caching,
        cache_outputs=cache_outputs,
    )
    return Scheduler(config, kv)


def _emit(out: SchedulerOutput, *runs: list[int]) -> StepOutput:
    """The step's result: runs[i] emitted by its i-th sampling row."""
    return StepOutput(
        step_id=out.step_id,
        request_ids=tuple(
            r for r, samples in zip(out.scheduled_request_ids, out.samples_token) if samples
        ),
        sampled_token_ids=np.asarray([t for run in runs for t in run], np.int64),
        logprobs=None,
        stats=StepStats(out.step_id, out.num_reqs, 0, 0),
        num_sampled_tokens=np.asarray([len(run) for run in runs], np.int32),
    )


def _schedule(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    assert out is not None
    return out


def _cached(kv: KVCacheManager, tokens: tuple[int, ...], salt: str | None = None) -> list[bool]:
    """Per full block of `tokens` (as a prompt would hash them): is it in the cache?"""
    hashes = hash_full_blocks(tokens, BLOCK_SIZE, salt)
    return [kv.pool.lookup(block_hash) is not None for block_hash in hashes]


def _admit_cached_tokens(scheduler: Scheduler, request_id: str, prompt, salt=None) -> int:
    """Admit a request with `prompt` alone and return its prefix-cache hit, in tokens."""
    scheduler.add_request(engine_request(request_id, prompt, max_tokens=1, cache_salt=salt))
    out = _schedule(scheduler)
    (new,) = out.new_requests
    scheduler.update_from_step(_emit(out, [0]))  # max_tokens=1: the request finishes
    return new.num_computed_tokens


def _finish_turn(scheduler: Scheduler, request_id: str, max_tokens: int, salt=None):
    """Run one request alone to its max_tokens (one step in flight); its tokens."""
    scheduler.add_request(
        engine_request(request_id, PROMPT, max_tokens=max_tokens, cache_salt=salt)
    )
    token = 200
    while scheduler.get_request(request_id) is not None:
        out = _schedule(scheduler)
        scheduler.update_from_step(_emit(out, [token]))
        token += 1
    scheduler.free_finished_blocks()
    return PROMPT + tuple(range(200, token))


def test_a_decoded_block_is_published_once_its_last_token_is_computed() -> None:
    scheduler = _scheduler(max_steps_in_flight=1)
    kv = scheduler.kv
    scheduler.add_request(engine_request("a", PROMPT, max_tokens=10))
    scheduler.update_from_step(_emit(_schedule(scheduler), [60]))  # prefill: 7 tokens known
    scheduler.update_from_step(_emit(_schedule(scheduler), [61]))  # computes position 6
    tokens = PROMPT + (60, 61)
    # Block 1 holds 4 known tokens, but position 7's KV (token 61) is not computed yet.
    assert _cached(kv, tokens) == [True, False]
    _schedule(scheduler)  # the step that computes position 7
    assert _cached(kv, tokens) == [True, True]
    assert kv.pool.lookup(hash_full_blocks(tokens, BLOCK_SIZE)[1]) == kv.block_ids("a")[1]


def test_with_two_steps_in_flight_a_block_is_published_when_its_last_token_arrives() -> None:
    # The overlapped loop builds the step computing a sampled token's KV before the token
    # is known: the block is published by the update that brings the token.
    scheduler = _scheduler(max_steps_in_flight=2)
    kv = scheduler.kv
    scheduler.add_request(engine_request("a", PROMPT, max_tokens=10))
    prefill = _schedule(scheduler)
    first_decode = _schedule(scheduler)  # position 6: a placeholder
    scheduler.update_from_step(_emit(prefill, [60]))
    second_decode = _schedule(scheduler)  # position 7: a placeholder
    assert second_decode.num_computed_tokens == (7,)
    tokens = PROMPT + (60, 61)
    assert _cached(kv, tokens) == [True, False]  # position 7 is scheduled, its token unknown
    scheduler.update_from_step(_emit(first_decode, [61]))
    assert _cached(kv, tokens) == [True, True]


@pytest.mark.parametrize("max_steps_in_flight", [1, 2])
def test_the_next_turn_hits_the_previous_answer_up_to_its_last_full_block(
    max_steps_in_flight: int,
) -> None:
    scheduler = _scheduler(max_steps_in_flight)
    run = FakeRunner(block_size=BLOCK_SIZE, max_num_seqs=4, manager=scheduler.kv)
    scheduler.add_request(engine_request("turn-1", PROMPT, max_tokens=8))
    run.register("turn-1", 8)
    while scheduler.has_unfinished_requests or run.pending_updates:
        while (out := scheduler.schedule()) is not None:
            run.execute(out)
        run.deliver_oldest(scheduler)
    tokens = PROMPT + tuple(run.outputs["turn-1"])  # 14 tokens; the last one's KV never ran
    assert _cached(scheduler.kv, tokens) == [True, True, True]
    turn_2 = tokens + (7, 8, 9)
    assert _admit_cached_tokens(scheduler, "turn-2", turn_2) == 12


def test_hashes_of_decoded_blocks_equal_those_of_the_same_prompt() -> None:
    scheduler = _scheduler(max_steps_in_flight=1)
    tokens = _finish_turn(scheduler, "a", max_tokens=11)  # 17 tokens, 16 computed
    kv = scheduler.kv
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    assert [kv.pool.lookup(h) is not None for h in hashes] == [True] * 4
    assert kv.stats().num_cached_blocks == 4  # nothing else was published
    assert _admit_cached_tokens(scheduler, "b", tokens + (1,)) == 16


def test_cache_salt_isolates_decoded_blocks() -> None:
    scheduler = _scheduler(max_steps_in_flight=1)
    tokens = _finish_turn(scheduler, "a", max_tokens=8, salt="tenant-1")
    assert _cached(scheduler.kv, tokens) == [False, False, False]
    assert _admit_cached_tokens(scheduler, "b", tokens + (1,), salt="tenant-2") == 0
    assert _admit_cached_tokens(scheduler, "c", tokens + (1,), salt="tenant-1") == 12


def test_freed_decoded_blocks_stay_cached_and_evictable() -> None:
    scheduler = _scheduler(max_steps_in_flight=1)
    tokens = _finish_turn(scheduler, "a", max_tokens=8)
    kv = scheduler.kv
    block_ids = [kv.pool.lookup(h) for h in hash_full_blocks(tokens, BLOCK_SIZE)]
    assert all(b is not None and kv.pool.is_evictable(b) for b in block_ids)
    assert kv.stats().num_used_blocks == 0
    kv.check_invariants()


def test_disabled_prefix_caching_publishes_no_decoded_block() -> None:
    scheduler = _scheduler(max_steps_in_flight=1, enable_prefix_caching=False)
    _finish_turn(scheduler, "a", max_tokens=8)
    assert scheduler.kv.stats().num_cached_blocks == 0


@pytest.mark.parametrize("cache_outputs", [True, False])
def test_the_next_turn_hits_the_answer_only_where_outputs_are_cached(cache_outputs: bool) -> None:
    scheduler = _scheduler(max_steps_in_flight=1, cache_outputs=cache_outputs)
    turn = _finish_turn(scheduler, "a", max_tokens=10)  # 6 + 10 tokens: 4 full blocks
    # The last token's KV is never computed, so the fourth block stays out either way.
    assert _cached(scheduler.kv, turn) == [True, cache_outputs, cache_outputs, False]
    hit = _admit_cached_tokens(scheduler, "b", turn + (7, 7, 7))
    assert hit == (3 if cache_outputs else 1) * BLOCK_SIZE
    scheduler.kv.check_invariants()


def test_rejected_drafts_never_publish_and_accepted_ones_do() -> None:
    scheduler = _scheduler(max_steps_in_flight=1, num_speculative_tokens=3)
    kv = scheduler.kv
    scheduler.add_request(engine_request("a", range(8), max_tokens=30))
    scheduler.update_from_step(_emit(_schedule(scheduler), [1]))  # 9 known
    probe = _schedule(scheduler)
    # Positions 8-11 fill block 2 with the last token and three draft slots...
    assert probe.num_draft_slots == (3,) and probe.num_scheduled_tokens == (4,)
    scheduler.update_from_step(_emit(probe, [2]))  # ...but every draft is rejected
    assert kv.stats().num_cached_blocks == 2
    known = tuple(range(8)) + (1, 2)
    while not (out := _schedule(scheduler)).num_draft_slots:  # backing off
        scheduler.update_from_step(_emit(out, [len(known)]))
        known += (len(known),)
    # Every draft accepted: their KV was computed in this step, the bonus token's was not.
    drafts = out.num_draft_slots[0]
    run = list(range(50, 51 + drafts))
    scheduler.update_from_step(_emit(out, run))
    known += tuple(run)
    request = scheduler.get_request("a")
    assert request is not None and request.all_token_ids == known
    num_full_computed = (len(known) - 1) // BLOCK_SIZE
    assert _cached(kv, known)[:num_full_computed] == [True] * num_full_computed
    assert kv.stats().num_cached_blocks == num_full_computed  # no hash of a rejected draft


def test_a_preempted_request_resumes_and_publishes_the_hashes_of_its_tokens() -> None:
    # 5 blocks of 4: two requests of 6 prompt tokens decoding 10 each cannot both stay.
    scheduler = _scheduler(max_steps_in_flight=2, num_blocks=5)
    run = FakeRunner(block_size=BLOCK_SIZE, max_num_seqs=4, manager=scheduler.kv)
    for name in ("a", "b"):
        scheduler.add_request(engine_request(name, PROMPT, max_tokens=10))
        run.register(name, 10)
    requests = {name: scheduler.get_request(name) for name in ("a", "b")}
    while scheduler.has_unfinished_requests or run.pending_updates:
        while (out := scheduler.schedule()) is not None:
            run.execute(out)
        run.deliver_oldest(scheduler)
    assert requests["b"].num_preemptions > 0
    kv = scheduler.kv
    real_hashes = {
        h
        for request in requests.values()
        for h in hash_full_blocks(request.all_token_ids, BLOCK_SIZE)
    }
    cached = {kv.pool.block_hash(b) for b in range(kv.pool.num_blocks)} - {None}
    assert cached and cached <= real_hashes
    tokens = requests["b"].all_token_ids  # 16 tokens, 15 computed: 3 full blocks
    assert _cached(kv, tokens) == [True, True, True, False]
    assert _admit_cached_tokens(scheduler, "b-next", tokens + (1,)) == 12


def test_cache_blocks_ignores_a_request_whose_blocks_were_freed() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    kv.cache_blocks("gone", PROMPT, [1, 2], 8)
    assert kv.stats().num_cached_blocks == 0


def test_resumed_request_hashes_extend_its_admission_hashes() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    resumed = PROMPT + (1, 2, 3)  # prompt + outputs, hashed at admission
    grant = kv.allocate_step(
        AllocateStep((), RunningAllocs(), (WaitingAlloc("a", resumed, 6, 64, "s"),), 64)
    ).waiting[0]
    assert grant.num_new_tokens == 9
    kv.cache_blocks("a", PROMPT, [1, 2, 3, 4], 9)  # 10 known: nothing new is full
    kv.cache_blocks("a", PROMPT, [1, 2, 3, 4, 5, 6], 12)  # block 2 full and computed
    hashes = hash_full_blocks(PROMPT + (1, 2, 3, 4, 5, 6), BLOCK_SIZE, "s")
    assert [kv.pool.lookup(h) for h in hashes] == list(kv.block_ids("a")[:3])


def test_reset_prefix_cache_drops_only_blocks_no_request_holds() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE)
    step = AllocateStep(
        (),
        RunningAllocs(),
        (WaitingAlloc("done", tuple(range(9)), 9, 64), WaitingAlloc("held", PROMPT, 6, 64)),
        64,
    )
    kv.allocate_step(step)
    kv.free(["done"])
    assert kv.stats().num_cached_blocks == 3
    assert kv.reset_prefix_cache() == 2  # "done"'s two blocks; "held" keeps its one
    kv.check_invariants()
    usage = kv.stats()
    assert usage.num_cached_blocks == 1 and usage.num_free_blocks == 14
    assert kv.pool.lookup(hash_full_blocks(tuple(range(9)), BLOCK_SIZE)[0]) is None
    assert kv.pool.lookup(hash_full_blocks(PROMPT, BLOCK_SIZE)[0]) == kv.block_ids("held")[0]
