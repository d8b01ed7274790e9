"""The pipeline's batch queue in the scheduler (SchedulerConfig.step_groups): with N groups,
N steps are in flight and no request samples in two of them at once; the running requests
split into groups that take turns, so each stage of a pipeline has a step to run."""

from __future__ import annotations

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.messages import SchedulerOutput
from tests.actors._kv_helpers import engine_request
from tests.actors.test_scheduler import answer


def _scheduler(step_groups: int, max_steps_in_flight: int = 2, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=256,
        block_size=16,
        max_steps_in_flight=max_steps_in_flight,
        step_groups=step_groups,
    )
    return Scheduler(config, KVCacheManager(num_blocks=64, block_size=16))


def _sampling(out: SchedulerOutput) -> set[str]:
    return {r for r, s in zip(out.scheduled_request_ids, out.samples_token) if s}


def _decode_in_pipeline(scheduler: Scheduler, num_steps: int) -> list[SchedulerOutput]:
    """Keep as many steps in flight as the scheduler allows, answering the oldest first
    (as the engine loop does)."""
    in_flight: list[SchedulerOutput] = []
    steps: list[SchedulerOutput] = []
    while len(steps) < num_steps:
        out = scheduler.schedule()
        if out is not None:
            for earlier in in_flight:
                assert not _sampling(out) & _sampling(earlier), "a request sampled twice"
            in_flight.append(out)
            steps.append(out)
            continue
        assert in_flight, "nothing in flight and nothing to schedule"
        scheduler.update_from_step(answer(in_flight.pop(0)))
    return steps


def test_running_requests_split_into_groups_that_take_turns() -> None:
    scheduler = _scheduler(step_groups=2)
    for name in "abcd":
        scheduler.add_request(engine_request(name, range(8), max_tokens=50))
    steps = _decode_in_pipeline(scheduler, 10)
    assert _sampling(steps[0]) == {"a", "b", "c", "d"}  # the prefill: nothing runs yet
    decodes = [_sampling(s) for s in steps[2:]]
    assert all(len(group) == 2 for group in decodes)
    assert decodes[0] | decodes[1] == {"a", "b", "c", "d"}
    assert decodes[::2] == [decodes[0]] * len(decodes[::2])  # the same groups alternate
    assert decodes[1::2] == [decodes[1]] * len(decodes[1::2])


def test_every_group_has_a_step_in_flight_with_three_stages() -> None:
    scheduler = _scheduler(step_groups=3, max_steps_in_flight=3)
    for name in "abcdef":
        scheduler.add_request(engine_request(name, range(8), max_tokens=50))
    steps = _decode_in_pipeline(scheduler, 12)
    later = [_sampling(s) for s in steps[-6:]]
    assert all(len(group) == 2 for group in later)
    assert set().union(*later[:3]) == set("abcdef")


def test_a_chunked_prefill_goes_on_while_its_previous_chunk_is_in_flight() -> None:
    scheduler = _scheduler(step_groups=2, budget=16)
    scheduler.add_request(engine_request("long", range(40), max_tokens=4))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first is not None and second is not None  # no token is awaited between chunks
    assert first.num_computed_tokens == (0,) and second.num_computed_tokens == (16,)
    assert scheduler.schedule() is None  # two in flight: the bound


def test_without_groups_a_request_decodes_in_consecutive_steps_in_flight() -> None:
    scheduler = _scheduler(step_groups=1)
    scheduler.add_request(engine_request("a", range(8), max_tokens=10))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first is not None and second is not None
    assert _sampling(first) == _sampling(second) == {"a"}  # its token is a placeholder


def test_with_groups_a_request_waits_for_its_token() -> None:
    scheduler = _scheduler(step_groups=2)
    scheduler.add_request(engine_request("a", range(8), max_tokens=10))
    first = scheduler.schedule()
    assert first is not None and scheduler.schedule() is None
    scheduler.update_from_step(answer(first))
    following = scheduler.schedule()
    assert following is not None and _sampling(following) == {"a"}
