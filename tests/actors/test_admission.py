"""The admission actor against a fake engine: capacity, limits, drain, release and abort."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import pytest

from actors.frontend.admission import (
    AdmissionActor,
    AdmissionLimits,
    AdmissionRefused,
    RequestLimitError,
    check_request_limits,
    child_sampling_params,
)
from actors.frontend.output_stream import RequestStream
from actors.protocol.messages import (
    AbortAll,
    BeginDrain,
    EngineRequest,
    FailAll,
    ResumeAdmission,
)
from actors.protocol.sampling_params import SamplingParams


class FakeEngine:
    def __init__(self) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.aborted: list[str] = []

    def add_request(self, request: EngineRequest) -> RequestStream:
        stream = RequestStream(request.request_id, len(request.prompt_token_ids))
        self.streams[request.request_id] = stream
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.streams[request_id].push(finish_reason="abort")


_next_id = 0


def _requests(num: int, num_prompt_tokens: int = 4) -> list[EngineRequest]:
    global _next_id
    out = []
    for _ in range(num):
        _next_id += 1
        out.append(
            EngineRequest(
                request_id=f"r{_next_id}",
                prompt_token_ids=tuple(range(1, num_prompt_tokens + 1)),
                sampling_params=SamplingParams(),
                arrival_time=time.monotonic(),
            )
        )
    return out


@contextlib.asynccontextmanager
async def running_actor() -> AsyncIterator[tuple[AdmissionActor, FakeEngine]]:
    engine = FakeEngine()
    actor = AdmissionActor(
        engine,
        AdmissionLimits(
            max_num_running=2, max_queued_requests=2, max_queued_prompt_tokens=100, retry_after_s=3
        ),
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        try:
            yield actor, engine
        finally:
            actor.close()


async def test_admits_running_plus_queued_then_refuses_with_429() -> None:
    async with running_actor() as (actor, engine):
        groups = [await actor.admit(_requests(1), SamplingParams()) for _ in range(4)]
        with pytest.raises(AdmissionRefused) as refused:
            await actor.admit(_requests(1), SamplingParams())
        assert refused.value.status == 429 and refused.value.retry_after_s == 3
        stats = await actor.stats()
        assert (stats.num_unfinished, stats.num_queued, stats.num_refused_total) == (4, 2, 1)
        assert len(engine.streams) == 4
        # A finished request frees its place.
        engine.streams[groups[0].request_ids[0]].push((5,), "x", finish_reason="stop")
        assert (await groups[0].get(0)).finish_reason == "stop"
        await actor.admit(_requests(1), SamplingParams())


async def test_output_the_engine_finished_holds_no_place_while_it_waits_to_be_read() -> None:
    """A client that does not read keeps its request admitted (its output waits), but the
    engine is done with it: its place goes to the next request."""
    async with running_actor() as (actor, engine):
        groups = [await actor.admit(_requests(1), SamplingParams()) for _ in range(4)]
        with pytest.raises(AdmissionRefused):
            await actor.admit(_requests(1), SamplingParams())
        engine.streams[groups[0].request_ids[0]].push((5,), "x", finish_reason="length")
        engine.streams[groups[1].request_ids[0]].push((6,), "y")  # first token, unread
        stats = await actor.stats()
        assert (stats.num_unfinished, stats.num_unsent, stats.num_queued) == (4, 1, 1)
        assert stats.num_queued_prompt_tokens == 2 * 4  # two requests still wait for prefill
        late = await actor.admit(_requests(1), SamplingParams())
        assert (await groups[0].get(0)).finish_reason == "length"  # read at last: released
        stats = await actor.stats()
        assert (stats.num_unfinished, stats.num_unsent) == (4, 0)
        late.close()
        await actor.stats()  # the close has been handled
        assert engine.aborted == late.request_ids


async def test_a_request_is_all_or_nothing() -> None:
    async with running_actor() as (actor, engine):
        await actor.admit(_requests(3), SamplingParams(n=3))
        with pytest.raises(AdmissionRefused):
            await actor.admit(_requests(2), SamplingParams(n=2))
        assert len(engine.streams) == 3
        with pytest.raises(RequestLimitError) as too_big:
            await actor.admit(_requests(5), SamplingParams(n=5))
        assert too_big.value.param == "n"


async def test_queued_prompt_tokens_limit_counts_until_first_token() -> None:
    async with running_actor() as (actor, engine):
        # Nothing is queued: a prompt above the limit still gets in.
        big = await actor.admit(_requests(1, num_prompt_tokens=150), SamplingParams())
        with pytest.raises(AdmissionRefused) as refused:
            await actor.admit(_requests(1, num_prompt_tokens=10), SamplingParams())
        assert refused.value.status == 429
        assert (await actor.stats()).num_queued_prompt_tokens == 150
        engine.streams[big.request_ids[0]].push((7,), "a")
        await big.get(0)  # first token: its prompt no longer waits
        await actor.admit(_requests(1, num_prompt_tokens=90), SamplingParams())
        assert (await actor.stats()).num_queued_prompt_tokens == 90


@pytest.mark.parametrize(
    "params, param",
    [
        (SamplingParams(n=17), "n"),
        (SamplingParams(stop=tuple(f"s{i}" for i in range(17))), "stop"),
        (SamplingParams(stop=("x" * 257,)), "stop"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))), "logit_bias"),
    ],
)
def test_per_request_limits_name_the_field(params: SamplingParams, param: str) -> None:
    with pytest.raises(RequestLimitError) as err:
        check_request_limits(params, AdmissionLimits(max_num_running=4))
    assert err.value.param == param


async def test_drain_refuses_with_503_and_wait_idle_follows_releases() -> None:
    async with running_actor() as (actor, engine):
        group = await actor.admit(_requests(2), SamplingParams(n=2))
        actor.tell(BeginDrain())
        with pytest.raises(AdmissionRefused) as refused:
            await actor.admit(_requests(1), SamplingParams())
        assert refused.value.status == 503
        idle = False

        async def wait() -> None:
            nonlocal idle
            await actor.wait_idle()
            idle = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            for index, request_id in enumerate(group.request_ids):
                await anyio.sleep(0.01)
                assert not idle
                engine.streams[request_id].push((1,), "t", finish_reason="length")
                assert (await group.get(index)).finished
        assert idle


async def test_close_aborts_only_unfinished_requests() -> None:
    async with running_actor() as (actor, engine):
        group = await actor.admit(_requests(2), SamplingParams(n=2))
        done_id, open_id = group.request_ids
        engine.streams[done_id].push((1,), "t", finish_reason="stop")
        group.close()
        await actor.wait_idle()
        assert engine.aborted == [open_id]


async def test_abort_all_and_fail_all_end_every_stream() -> None:
    async with running_actor() as (actor, _engine):
        first = await actor.admit(_requests(1), SamplingParams())
        actor.tell(AbortAll())
        assert (await first.get(0)).finish_reason == "abort"
        second = await actor.admit(_requests(1), SamplingParams())
        actor.tell(FailAll("engine died"))
        delta = await second.get(0)
        assert delta.finish_reason == "error" and delta.error == "engine died"
        with pytest.raises(AdmissionRefused) as refused:
            await actor.admit(_requests(1), SamplingParams())
        assert refused.value.status == 503


async def test_a_retryable_fail_ends_every_stream_and_refuses_only_until_resumed() -> None:
    """The core stopped answering: the streams end with a retryable error and are aborted
    in the core (whose KV they hold), new requests get 503 until the core answers again."""
    async with running_actor() as (actor, engine):
        group = await actor.admit(_requests(2), SamplingParams(n=2))
        actor.tell(FailAll("the engine stopped responding", retryable=True))
        for index in range(2):
            delta = await group.get(index)
            assert delta is not None and delta.finish_reason == "error" and delta.retryable
            assert delta.error == "the engine stopped responding"
        assert sorted(engine.aborted) == sorted(group.request_ids)
        with pytest.raises(AdmissionRefused) as refused:
            await actor.admit(_requests(1), SamplingParams())
        assert refused.value.status == 503 and refused.value.retry_after_s == 3
        assert "stopped responding" in refused.value.message
        actor.tell(ResumeAdmission())
        again = await actor.admit(_requests(1), SamplingParams())
        engine.streams[again.request_ids[0]].push((1,), "t", finish_reason="stop")
        delta = await again.get(0)
        assert delta is not None and delta.finish_reason == "stop" and not delta.retryable


def test_child_sampling_params_offset_seeds() -> None:
    params = SamplingParams(n=3, seed=10, temperature=0.7)
    children = [child_sampling_params(params, i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 for c in children)
    unseeded = SamplingParams(n=2)
    assert [child_sampling_params(unseeded, i).seed for i in range(2)] == [None, None]
    top = SamplingParams(n=2, seed=2**64 - 1)
    assert child_sampling_params(top, 1).seed == 2**64 - 2
    assert child_sampling_params(SamplingParams(), 0) == SamplingParams()
