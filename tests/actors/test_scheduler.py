from __future__ import annotations

import numpy as np
import pytest

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.request import RequestStatus
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.messages import EngineRequest, SchedulerOutput, StepOutput, StepStats
from actors.protocol.sampling_params import SamplingParams
from tests.actors._kv_helpers import (
    EOS_TOKEN_ID,
    FakeRunner,
    engine_request,
)


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    max_steps_in_flight: int = 1,
) -> tuple[Scheduler, KVCacheManager]:
    manager = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        max_steps_in_flight=max_steps_in_flight,
    )
    return Scheduler(config, manager), manager


def schedule(scheduler: Scheduler) -> SchedulerOutput | None:
    return scheduler.schedule()


def step_output(
    step_id: int, request_ids: tuple[str, ...], token_ids: tuple[int, ...]
) -> StepOutput:
    return StepOutput(
        step_id,
        request_ids,
        np.asarray(token_ids, dtype=np.int64),
        None,
        StepStats(step_id, len(request_ids), len(request_ids), 0),
    )


def answer(
    out: SchedulerOutput, token_id: int = 7, overrides: dict[str, int] | None = None
) -> StepOutput:
    """A step result with `token_id` for every request that sampled (`overrides` names
    other tokens for some)."""
    sampled = tuple(rid for rid, s in zip(out.scheduled_request_ids, out.samples_token) if s)
    tokens = tuple((overrides or {}).get(rid, token_id) for rid in sampled)
    return step_output(out.step_id, sampled, tokens)


def run_step(scheduler: Scheduler, **answer_kwargs: object) -> SchedulerOutput:
    out = schedule(scheduler)
    assert out is not None
    scheduler.update_from_step(answer(out, **answer_kwargs))  # type: ignore[arg-type]
    return out


def test_chunked_prefill_splits_a_long_prompt_under_a_small_budget() -> None:
    scheduler, manager = make_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(engine_request("a", range(100)))
    steps = [run_step(scheduler) for _ in range(4)]
    assert [s.num_scheduled_tokens for s in steps] == [(32,), (32,), (32,), (4,)]
    assert [s.num_computed_tokens for s in steps] == [(0,), (32,), (64,), (96,)]
    assert [s.samples_token for s in steps] == [(False,), (False,), (False,), (True,)]
    assert [len(s.new_requests) for s in steps] == [1, 0, 0, 0]
    assert steps[0].new_requests[0].block_ids == manager.block_ids("a")[:2]
    assert [len(b) for s in steps[1:] for b in s.cached_requests.new_block_ids] == [2, 2, 1]
    request = scheduler.get_request("a")
    assert request is not None and request.output_token_ids == [7]


def test_decodes_run_before_new_prefills() -> None:
    scheduler, _ = make_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(engine_request("a", range(8), max_tokens=20))
    run_step(scheduler)
    scheduler.add_request(engine_request("b", range(100, 200)))
    out = run_step(scheduler)
    assert out.scheduled_request_ids == ("a", "b")
    assert out.num_scheduled_tokens == (1, 31) and out.samples_token == (True, False)
    assert out.cached_requests.request_ids == ("a",)
    assert [new.request_id for new in out.new_requests] == ["b"]


def test_max_num_seqs_bounds_the_running_requests() -> None:
    scheduler, _ = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(engine_request(name, range(4)))
    first = run_step(scheduler, overrides={"a": EOS_TOKEN_ID})
    assert first.scheduled_request_ids == ("a", "b") and scheduler.num_waiting == 1
    second = run_step(scheduler)
    assert second.scheduled_request_ids == ("b", "c") and second.finished_request_ids == {"a"}
    assert scheduler.num_running == 2


def test_preemption_frees_the_newest_request_which_resumes_with_its_outputs() -> None:
    # 4 blocks of 4 tokens: two requests fit at first, then the older one's growth
    # pushes the newer one out.
    scheduler, manager = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    runner = FakeRunner(block_size=4, max_num_seqs=8, manager=manager)
    for name in "ab":
        scheduler.add_request(engine_request(name, range(6), max_tokens=10))
        runner.register(name, 10)
    outputs_at_preemption: list[int] | None = None
    resumed = None
    for _ in range(60):
        out = schedule(scheduler)
        if out is None:
            break
        if "b" in out.finished_request_ids and outputs_at_preemption is None:
            outputs_at_preemption = list(runner.outputs["b"])
        if outputs_at_preemption is not None and resumed is None:
            resumed = next((new for new in out.new_requests if new.request_id == "b"), None)
        runner.execute(out)
        runner.deliver_oldest(scheduler)
        manager.check_invariants()
    assert outputs_at_preemption, "b was never preempted"
    assert scheduler.num_preemptions_total >= 1
    assert resumed is not None and resumed.prompt_len == 6
    assert resumed.token_ids == tuple(range(6)) + tuple(outputs_at_preemption)
    assert runner.finished == {"a": "length", "b": "length"}
    assert not scheduler.has_unfinished_requests


def test_a_preempted_request_waits_for_its_in_flight_token_before_resuming() -> None:
    # a and r fill the pool with their prompts; a is then done (max_tokens=1) while r's
    # first decode needs a new block: r is preempted with its first token still in flight.
    scheduler, manager = make_scheduler(
        num_blocks=4, block_size=4, max_model_len=16, max_steps_in_flight=2
    )
    runner = FakeRunner(block_size=4, max_num_seqs=8, manager=manager)
    scheduler.add_request(engine_request("a", range(8), max_tokens=1))
    scheduler.add_request(engine_request("r", range(20, 28), max_tokens=4))
    runner.register("a", 1)
    runner.register("r", 4)
    step0 = schedule(scheduler)
    assert step0 is not None and step0.scheduled_request_ids == ("a", "r")
    runner.execute(step0)
    assert schedule(scheduler) is None
    r = scheduler.get_request("r")
    assert r is not None and r.status is RequestStatus.PREEMPTED and r.num_output_placeholders == 1
    assert schedule(scheduler) is None  # r's token from step 0 has not arrived
    runner.deliver_oldest(scheduler)
    resumed = schedule(scheduler)
    assert resumed is not None and resumed.finished_request_ids == {"a", "r"}
    runner.execute(resumed)
    assert resumed.new_requests[0].token_ids == tuple(range(20, 28)) + tuple(runner.outputs["r"])


def test_lowest_priority_request_is_preempted_even_if_admitted_first() -> None:
    scheduler, manager = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    scheduler.add_request(engine_request("low", range(6), max_tokens=10, priority=1))
    run_step(scheduler)
    scheduler.add_request(engine_request("high", range(50, 56), max_tokens=10, priority=0))
    while scheduler.num_preemptions_total == 0:
        run_step(scheduler)
    low, high = scheduler.get_request("low"), scheduler.get_request("high")
    assert low is not None and low.status is RequestStatus.PREEMPTED and low.num_preemptions == 1
    assert high is not None and high.status is RequestStatus.RUNNING
    assert manager.block_ids("low") == ()


def test_two_steps_in_flight_count_placeholders() -> None:
    scheduler, _ = make_scheduler(max_steps_in_flight=2)
    scheduler.add_request(engine_request("a", range(8), max_tokens=3))
    step0 = schedule(scheduler)
    step1 = schedule(scheduler)
    assert step0 is not None and step1 is not None
    request = scheduler.get_request("a")
    assert request is not None
    assert step1.num_computed_tokens == (8,) and step1.num_scheduled_tokens == (1,)
    assert step1.samples_token == (True,) and request.num_output_placeholders == 2
    assert schedule(scheduler) is None and scheduler.num_steps_in_flight == 2
    scheduler.update_from_step(answer(step0, token_id=41))
    assert request.output_token_ids == [41] and request.num_output_placeholders == 1
    step2 = schedule(scheduler)
    assert step2 is not None and step2.num_computed_tokens == (9,)
    # The third output is in flight: max_tokens is reached, nothing more is scheduled.
    scheduler.update_from_step(answer(step1, token_id=42))
    assert schedule(scheduler) is None
    result = scheduler.update_from_step(answer(step2, token_id=43))
    assert request.output_token_ids == [41, 42, 43]
    assert [(r, f.reason) for r, f in result.finished] == [(request, "length")]
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_tokens_of_a_finished_request_still_in_flight_are_dropped() -> None:
    scheduler, _ = make_scheduler(max_steps_in_flight=2)
    scheduler.add_request(engine_request("a", range(8), max_tokens=10))
    step0, step1 = schedule(scheduler), schedule(scheduler)
    assert step0 is not None and step1 is not None
    request = scheduler.get_request("a")
    scheduler.update_from_step(answer(step0, token_id=EOS_TOKEN_ID))
    dropped = scheduler.update_from_step(answer(step1))
    assert dropped.requests == [] and dropped.finished == []
    assert request is not None and request.output_token_ids == [EOS_TOKEN_ID]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert schedule(scheduler) is None


def test_aborts_free_blocks_and_rows() -> None:
    scheduler, manager = make_scheduler(max_num_seqs=1)
    scheduler.add_request(engine_request("run", range(40)))
    scheduler.add_request(engine_request("wait", range(40)))
    run_step(scheduler)
    assert manager.stats().num_used_blocks == 3
    assert scheduler.abort_requests(["run", "wait", "unknown"]) == ["run", "wait"]
    assert not scheduler.has_unfinished_requests
    assert schedule(scheduler) is None  # nothing to run: the blocks are freed at once
    assert manager.stats().num_used_blocks == 0
    manager.check_invariants()
    scheduler.add_request(engine_request("next", range(5)))
    out = run_step(scheduler)
    assert out.finished_request_ids == {"run"}  # only a request holding a row frees one


def test_priority_then_arrival_order_admission() -> None:
    scheduler, _ = make_scheduler(max_num_seqs=1)
    scheduler.add_request(engine_request("late-low", range(4), arrival_time=0.0, priority=5))
    scheduler.add_request(engine_request("high-2", range(4), arrival_time=2.0, priority=0))
    scheduler.add_request(engine_request("high-1", range(4), arrival_time=1.0, priority=0))
    order = []
    for _ in range(3):
        out = schedule(scheduler)
        assert out is not None and len(out.new_requests) == 1
        order.append(out.new_requests[0].request_id)
        scheduler.update_from_step(answer(out, token_id=EOS_TOKEN_ID))
    assert order == ["high-1", "high-2", "late-low"]


def test_prefix_cache_hit_reaches_the_runner_as_computed_tokens() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(engine_request("a", range(40), max_tokens=1))
    run_step(scheduler)
    scheduler.add_request(engine_request("b", range(40)))
    out = run_step(scheduler)
    assert out.new_requests[0].num_computed_tokens == 32
    assert out.num_computed_tokens == (32,) and out.num_scheduled_tokens == (8,)
    request = scheduler.get_request("b")
    assert request is not None and request.num_cached_tokens == 32


def test_a_request_that_sampled_but_got_no_token_finishes_with_error() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(engine_request("a", range(4)))
    out = schedule(scheduler)
    assert out is not None
    result = scheduler.update_from_step(step_output(out.step_id, (), ()))
    ((request, finish),) = result.finished
    assert request.status is RequestStatus.FINISHED_ERROR and finish.reason == "error"


def test_bad_updates_and_requests_raise_value_errors() -> None:
    scheduler, _ = make_scheduler(max_model_len=16)
    scheduler.add_request(engine_request("a", range(4)))
    with pytest.raises(ValueError, match="already in the engine"):
        scheduler.add_request(engine_request("a", range(4)))
    with pytest.raises(ValueError, match="no room for output"):
        scheduler.add_request(engine_request("long", range(16)))
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add_request(engine_request("empty", []))
    out = schedule(scheduler)
    assert out is not None
    with pytest.raises(ValueError, match="out of order"):
        scheduler.update_from_step(step_output(out.step_id + 1, (), ()))
    with pytest.raises(ValueError, match="did not sample"):
        scheduler.update_from_step(step_output(out.step_id, ("zzz",), (1,)))
    with pytest.raises(ValueError, match="did not sample"):
        scheduler.update_from_step(step_output(out.step_id, ("a", "a"), (1, 1)))
    request = scheduler.get_request("a")
    assert request is not None and request.output_token_ids == []  # nothing half-applied
    scheduler.update_from_step(answer(out))
    assert request.output_token_ids == [7]


def test_invalid_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8, max_model_len=8, block_size=4)


def _stop_request(request_id: str, **params: object) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=(1, 2, 3, 4),
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        arrival_time=0.0,
        eos_token_ids=(EOS_TOKEN_ID,),
    )


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "stop_token_id", "num_outputs"),
    [
        ({"max_tokens": 8}, [5, EOS_TOKEN_ID], "stop", None, 2),
        (
            {"max_tokens": 8, "min_tokens": 3},
            [EOS_TOKEN_ID, EOS_TOKEN_ID, EOS_TOKEN_ID],
            "stop",
            None,
            3,
        ),
        ({"max_tokens": 8, "ignore_eos": True}, [EOS_TOKEN_ID] * 8, "length", None, 8),
        ({"max_tokens": 8, "stop_token_ids": (42,)}, [5, 42], "stop", 42, 2),
        ({"max_tokens": 8, "stop_token_ids": (42,), "min_tokens": 2}, [42, 42], "stop", 42, 2),
        ({"max_tokens": 3}, [5, 6, 7], "length", None, 3),
        # EOS listed as a stop token id too: EOS wins (no stop token named) unless ignored
        ({"max_tokens": 8, "stop_token_ids": (EOS_TOKEN_ID,)}, [EOS_TOKEN_ID], "stop", None, 1),
        (
            {"max_tokens": 8, "stop_token_ids": (EOS_TOKEN_ID,), "ignore_eos": True},
            [5, EOS_TOKEN_ID],
            "stop",
            EOS_TOKEN_ID,
            2,
        ),
    ],
)
def test_token_level_stops_are_decided_in_the_scheduler(
    params: dict[str, object],
    tokens: list[int],
    reason: str,
    stop_token_id: int | None,
    num_outputs: int,
) -> None:
    """EOS (unless ignore_eos) and stop_token_ids count from the min_tokens-th output on,
    then max_tokens; the finish names the stop token id (None for EOS)."""
    scheduler, manager = make_scheduler()
    scheduler.add_request(_stop_request("a", **params))
    finishes = []
    for token_id in tokens:
        out = schedule(scheduler)
        assert out is not None
        finishes.extend(scheduler.update_from_step(answer(out, token_id=token_id)).finished)
        if finishes:
            break
    ((request, finish),) = finishes
    assert (finish.reason, finish.stop_token_id) == (reason, stop_token_id)
    assert request.num_output_tokens == num_outputs
    assert schedule(scheduler) is None  # the finished request's blocks are freed
    assert manager.stats().num_used_blocks == 0
