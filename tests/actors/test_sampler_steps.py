"""Output processing across steps: failed and mismatched steps, aborts, readers that
leave, fail_all, timings, and the sampler actor's routing."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from actors.frontend.output_stream import RequestStream
from actors.frontend.sampler import SamplerActor
from actors.protocol.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineRequest,
    RegisterRequest,
    RequestFinish,
    StepOutput,
    StepStats,
)
from actors.protocol.sampling_params import SamplingParams
from tests.actors._sampler_harness import EOS, Harness, ids
from tests.actors._tokenizer_fixtures import tiny_tokenizer


async def test_tokens_of_a_finished_request_in_a_later_step_are_ignored():
    h = Harness()
    h.add("a", max_tokens=1)
    h.add("b", max_tokens=5)
    first = h.step({"a": ids("x")[0], "b": ids("y")[0]})
    assert first.finished == {"a": "length"} and first.request_ids == ("b",)
    # The next step was already in flight with both requests.
    second = h.step({"a": ids("z")[0], "b": ids("w")[0]})
    assert second.request_ids == ("b",) and second.finished == {}
    assert (await h.read_all("a")).token_ids == (ids("x")[0],)


async def test_a_failed_step_fails_only_its_requests():
    h = Harness()
    h.add("a", max_tokens=5)
    h.add("b", max_tokens=5)
    h.step({"a": ids("x")[0], "b": ids("y")[0]})
    update = h.step({}, error="RuntimeError: CUDA error", failed=("a", "b"))
    assert update.finished == {"a": "error", "b": "error"} and update.request_ids == ()
    h.add("c", max_tokens=5)  # the engine goes on with the next requests
    assert h.step({"c": ids("z")[0]}).request_ids == ("c",)
    out = await h.read_all("a")
    assert (out.finish_reason, out.error, out.text) == ("error", "RuntimeError: CUDA error", "x")
    assert h.processor.has_request("c") and not h.processor.has_request("a")


async def test_one_message_per_step_carries_tokens_in_batch_order_and_core_finishes():
    h = Harness()
    for rid in ("r1", "r2", "r3"):
        h.add(rid, max_tokens=5)
    sched = h.scheduler.schedule()
    tokens = {"r1": EOS, "r2": ids("b")[0], "r3": ids("a")[0]}
    out = StepOutput(
        sched.step_id,
        ("r1", "r2", "r3"),
        np.array([tokens[r] for r in ("r1", "r2", "r3")], np.int64),
        None,
        StepStats(sched.step_id, 3, 3, 0),
    )
    h.core_outputs.step(out, h.scheduler.update_from_step(out))
    (message,) = h.sent
    assert message.request_ids == ("r1", "r2", "r3")
    assert message.new_token_ids.tolist() == [EOS, ids("b")[0], ids("a")[0]]
    assert message.finished == (RequestFinish("r1", "stop"),)
    assert message.step_stats is not None  # front end 0 records every step's timings
    assert h.processor.process_outputs(message) == []  # nothing for the core to abort
    assert (await h.read_all("r1")).finish_reason == "stop"


async def test_mismatched_step_arrays_fail_the_step_requests():
    h = Harness()
    h.add("a", max_tokens=5)
    sched = h.scheduler.schedule()
    out = StepOutput(
        sched.step_id, ("a",), np.array([1, 2], np.int64), None, StepStats(sched.step_id, 1, 1, 0)
    )
    h.core_outputs.step(out, h.scheduler.update_from_step(out))
    h.processor.process_outputs(h.sent[0])
    assert "2 tokens for 1 requests" in (await h.read_all("a")).error


class FailingDecoder:
    """Decodes like the tiny tokenizer but raises on one token id."""

    def __init__(self, bad_id: int):
        self.bad_id = bad_id

    def decode(self, ids, skip_special_tokens=True):
        if self.bad_id in ids:
            raise RuntimeError("cannot decode")
        return tiny_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)


async def test_a_request_whose_output_cannot_be_processed_fails_alone():
    bad = ids("q")[0]
    h = Harness(FailingDecoder(bad))
    h.add("a", max_tokens=5)
    h.add("b", max_tokens=5)
    update = h.step({"a": bad, "b": ids("x")[0]})
    assert update.finished == {"a": "error"} and update.request_ids == ("b",)
    error = (await h.read_all("a")).error  # it reaches the client: the type, not the text
    assert error is not None and "RuntimeError" in error and "cannot decode" not in error


async def test_abort_closes_the_stream_and_later_tokens_are_ignored():
    h = Harness()
    h.add("a", max_tokens=5, stop=("zz",))
    h.step({"a": ids("z")[0]})
    assert h.processor.abort("a") and not h.processor.abort("a")
    assert h.step({"a": ids("q")[0]}).finished == {}  # the scheduler already knows
    out = await h.read_all("a")
    assert (out.finish_reason, out.text) == ("abort", "z")


async def test_a_reader_that_went_away_is_aborted_in_the_core():
    h = Harness()
    stream = h.add("a", max_tokens=5)
    await stream.aclose()
    message = EngineCoreOutputs(1, ("a",), np.array([ids("x")[0]], np.int32))
    assert h.processor.process_outputs(message) == ["a"]
    assert not h.processor.has_request("a")


async def test_tokens_after_a_stop_string_in_a_step_already_in_flight_are_ignored():
    h = Harness()
    h.add("a", max_tokens=10, stop=("x",))
    x, y = ids("x")[0], ids("y")[0]
    assert h.processor.process_outputs(EngineCoreOutputs(1, ("a",), np.array([x], np.int32))) == [
        "a"
    ]
    # The core ran the next step before it heard the abort: its token is dropped.
    assert h.processor.process_outputs(EngineCoreOutputs(2, ("a",), np.array([y], np.int32))) == []
    out = await h.read_all("a")
    assert (out.token_ids, out.text, out.stop_reason) == ((x,), "", "x")


async def test_fail_all_finishes_every_request_with_the_message():
    h = Harness()
    h.add("a", max_tokens=5)
    h.add("b", max_tokens=5, logprobs=1)
    assert sorted(h.processor.fail_all("engine died")) == ["a", "b"]
    a, b = await h.read_all("a"), await h.read_all("b")
    assert (a.finish_reason, a.error, a.logprobs) == ("error", "engine died", None)
    assert (b.finish_reason, b.logprobs) == ("error", ())
    assert h.processor.num_requests == 0


async def test_first_token_and_finish_times_are_recorded():
    h = Harness()
    h.add("a", max_tokens=2)
    h.step({"a": ids("x")[0]})
    h.step({"a": ids("y")[0]})
    out = await h.read_all("a")
    assert out.first_token_time is not None and out.finish_time is not None
    assert 0.0 < out.first_token_time <= out.finish_time


def test_a_request_id_cannot_be_added_twice():
    h = Harness()
    h.add("a")
    with pytest.raises(ValueError, match="already"):
        h.add("a")


async def test_sampler_actor_routes_messages_and_aborts_leftovers_on_stop():
    h = Harness()
    stopped: list[list[str]] = []
    actor = SamplerActor(h.processor, on_stopped=stopped.append)
    requests = [
        EngineRequest(rid, tuple(ids("Q:")), SamplingParams(max_tokens=5), 0.0, (EOS,))
        for rid in ("a", "b", "c")
    ]
    streams = {r.request_id: RequestStream(r.request_id, 2) for r in requests}
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        for request in requests:
            actor.tell(RegisterRequest(request, streams[request.request_id]))
        actor.tell(
            EngineCoreOutputs(
                1,
                ("a", "b"),
                np.array([ids("x")[0], EOS], np.int32),
                finished=(RequestFinish("b", "stop"),),
            )
        )
        actor.tell(AbortRequests(("a",)))
        actor.close()
    assert stopped == []  # the core ended b itself; a was aborted by its reader
    finals = {rid: [d async for d in s][-1] for rid, s in streams.items()}
    assert {rid: d.finish_reason for rid, d in finals.items()} == {
        "a": "abort",
        "b": "stop",
        "c": "abort",
    }
    with pytest.raises(AssertionError, match="unreachable"):  # and a type checker's error
        await SamplerActor(h.processor, on_stopped=stopped.append).handle("nonsense")  # type: ignore[arg-type]


async def test_an_error_that_comes_with_a_token_keeps_its_text():
    # A grammar the sampled token broke finishes the request in the same step as that
    # token; its reason must reach the client, not only 'error'.
    h = Harness()
    h.add("a", max_tokens=5)
    token = ids("x")[0]
    h.processor.process_outputs(
        EngineCoreOutputs(
            0,
            ("a",),
            np.array([token], np.int32),
            finished=(RequestFinish("a", "error", error="the output left its grammar: row"),),
        )
    )
    out = await h.read_all("a")
    assert (out.finish_reason, out.error, out.text) == (
        "error",
        "the output left its grammar: row",
        "x",
    )
