from __future__ import annotations

import math
from dataclasses import dataclass

import anyio
import numpy as np
import pytest

from actors.core_outputs import CoreOutputs
from actors.kv_cache_manager import KVCacheManager
from actors.logprob_text import LOGPROB_FLOOR, floor_logprobs
from actors.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineRequest,
    LogprobsArrays,
    RegisterRequest,
    RequestFinish,
    StepOutput,
    StepStats,
)
from actors.output_stream import RequestStream, StreamDelta
from actors.sampler import OutputProcessor, SamplerActor
from actors.sampling_params import SamplingParams
from actors.scheduler import Scheduler
from actors.scheduler_config import SchedulerConfig
from tests.actors._kv_helpers import DirectKVClient, run_sync
from tests.actors._tokenizer_fixtures import ByteLevelTokenBytes, byte_token_id, tiny_tokenizer

EOS = 0  # "<eos>" in the tiny tokenizer
STOP_ID = 1  # "<stop>"


def ids(text: str) -> list[int]:
    return tiny_tokenizer().encode(text).ids


@dataclass
class Step:
    """What one step did, as a client-facing summary."""

    request_ids: tuple[str, ...]
    """Requests that got a token and still run, in batch order."""
    finished: dict[str, str]
    """Finish reason of each request this step ended (in the core or by a stop string)."""


class Harness:
    """The split pipeline on one thread: a real scheduler (the core's token-level stops),
    the core's per-step outputs, and the front end's OutputProcessor, with the aborts the
    front end sends back applied to the scheduler."""

    def __init__(self, tokenizer=None, max_model_len=256):
        manager = KVCacheManager(num_blocks=512, block_size=16)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=max_model_len,
            block_size=16, max_steps_in_flight=1), DirectKVClient(manager))
        self.sent: list[EngineCoreOutputs] = []
        self.core_outputs = CoreOutputs(lambda client, message: self.sent.append(message))
        self.processor = OutputProcessor(tokenizer or tiny_tokenizer())
        self.streams: dict[str, RequestStream] = {}

    def add(self, request_id: str, prompt: str = "Q:", **params) -> RequestStream:
        request = EngineRequest(request_id, tuple(ids(prompt)), SamplingParams(**params),
                                arrival_time=0.0, eos_token_ids=(EOS,))
        stream = RequestStream(request_id, num_prompt_tokens=len(request.prompt_token_ids))
        self.processor.add_request(request, stream)
        self.scheduler.add_request(request)
        self.streams[request_id] = stream
        return stream

    def step(self, tokens: dict[str, int], logprobs: LogprobsArrays | None = None,
             error: str | None = None, failed: tuple[str, ...] = ()) -> Step:
        """Schedule a step, answer it with `tokens` (one per request that samples, in
        batch order), and push the outputs through the front end."""
        sched = run_sync(self.scheduler.schedule())
        step_id = sched.step_id if sched is not None else -1
        sampled = () if sched is None else tuple(
            rid for rid, s in zip(sched.scheduled_request_ids, sched.samples_token) if s)
        sampled = tuple(rid for rid in sampled if rid in tokens) if error is None else ()
        out = StepOutput(step_id, sampled, np.array([tokens[r] for r in sampled], np.int64),
                         logprobs, StepStats(step_id, len(sampled), len(sampled), 0),
                         error=error, failed_request_ids=failed)
        before = {rid for rid, st in self.streams.items() if not st.finished}
        if sched is not None:
            self.core_outputs.step(out, self.scheduler.update_from_step(out))
        for message in self.sent:
            self.scheduler.abort_requests(self.processor.process_outputs(message))
        self.sent.clear()
        finished = {rid: self.streams[rid]._finish_reason for rid in before
                    if self.streams[rid].finished}
        alive = tuple(rid for rid in sampled if rid not in finished and rid in before)
        return Step(alive, finished)

    def run(self, request_id: str, token_ids: list[int]) -> list[Step]:
        return [self.step({request_id: t}) for t in token_ids]

    async def read_all(self, request_id: str) -> StreamDelta:
        """Everything the client would have read, coalesced into one delta."""
        stream = self.streams[request_id]
        deltas = [d async for d in stream]
        logprobs = [e for d in deltas for e in (d.logprobs or ())]
        last = deltas[-1]
        return StreamDelta(
            request_id, tuple(t for d in deltas for t in d.token_ids),
            "".join(d.text for d in deltas),
            tuple(logprobs) if any(d.logprobs is not None for d in deltas) else None,
            last.finish_reason, last.stop_reason, last.error, last.num_prompt_tokens,
            last.num_cached_tokens, last.num_output_tokens, deltas[0].first_token_time,
            last.finish_time)


async def test_eos_finishes_with_stop_and_its_text_is_not_streamed():
    h = Harness()
    h.add("a", max_tokens=50)
    tokens = ids("hello") + [EOS]
    updates = h.run("a", tokens)
    assert [u.finished for u in updates] == [{}, {}, {"a": "stop"}]
    out = await h.read_all("a")
    assert (out.text, out.token_ids) == ("hello", tuple(tokens))
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert not h.processor.has_request("a")


async def test_ignore_eos_keeps_generating_until_max_tokens():
    h = Harness()
    h.add("a", max_tokens=4, ignore_eos=True, skip_special_tokens=False)
    updates = h.run("a", [EOS, EOS, EOS, EOS])
    assert [u.finished for u in updates] == [{}, {}, {}, {"a": "length"}]
    out = await h.read_all("a")
    assert (out.text, out.finish_reason, out.num_output_tokens) == ("<eos>" * 4, "length", 4)


@pytest.mark.parametrize("include", [False, True])
async def test_stop_token_ids_finish_with_the_token_as_stop_reason(include):
    h = Harness()
    stop_token = ids("!")[0]
    h.add("a", max_tokens=50, stop_token_ids=(stop_token,), include_stop_str_in_output=include)
    updates = h.run("a", ids("hi!") + ids("more"))
    assert [u.finished for u in updates[:3]] == [{}, {}, {"a": "stop"}]
    assert all(u.request_ids == () for u in updates[3:])  # later tokens are ignored
    out = await h.read_all("a")
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert out.text == ("hi!" if include else "hi")


async def test_max_tokens_finishes_with_length_on_the_last_allowed_token():
    h = Harness()
    h.add("a", max_tokens=3)
    updates = h.run("a", ids("abc"))
    assert [u.finished for u in updates] == [{}, {}, {"a": "length"}]
    assert (await h.read_all("a")).text == "abc"


async def test_context_length_caps_requests_without_max_tokens():
    h = Harness(max_model_len=len(ids("Q:")) + 2)
    h.add("a", max_tokens=None)
    assert h.step({"a": ids("x")[0]}).finished == {}
    assert h.step({"a": ids("y")[0]}).finished == {"a": "length"}


async def test_eos_at_exactly_max_tokens_reports_stop():
    h = Harness()
    h.add("a", max_tokens=2)
    assert h.run("a", ids("x") + [EOS])[-1].finished == {"a": "stop"}


async def test_min_tokens_eos_and_stop_ids_count_only_from_the_min_tokens_th_token():
    h = Harness()
    h.add("a", max_tokens=10, min_tokens=3, stop_token_ids=(STOP_ID,))
    updates = h.run("a", [EOS, STOP_ID, EOS])
    assert [u.finished for u in updates] == [{}, {}, {"a": "stop"}]
    out = await h.read_all("a")
    assert (out.num_output_tokens, out.stop_reason, out.text) == (3, None, "")


async def test_min_tokens_stop_strings_only_once_output_is_longer():
    h = Harness()
    h.add("a", max_tokens=10, min_tokens=2, stop=("x",))
    # Tokens 1 and 2 are "x": no stop yet. Token 3 ("x" again) is checked and fires.
    updates = h.run("a", ids("xxx"))
    assert [u.finished for u in updates] == [{}, {}, {"a": "stop"}]
    out = await h.read_all("a")
    assert (out.text, out.stop_reason) == ("xx", "x")


async def test_stop_string_across_tokens_cuts_text_and_leaks_no_partial():
    h = Harness()
    stream = h.add("a", max_tokens=50, stop=("llo w",))
    h.step({"a": ids("he")[0]})
    h.step({"a": ids("l")[0]})
    first = await stream.get()
    assert first is not None and first.text == "he"  # "l" may start "llo w": held back
    updates = h.run("a", ids("lo wörld"))  # l, o, " w" completes the stop string
    assert [u.finished for u in updates[:3]] == [{}, {}, {"a": "stop"}]
    rest = [d async for d in stream]
    assert "".join(d.text for d in rest) == ""
    assert (rest[-1].finish_reason, rest[-1].stop_reason) == ("stop", "llo w")


async def test_stop_string_beats_length_on_the_same_token():
    h = Harness()
    h.add("a", max_tokens=3, stop=("bc",))
    assert h.run("a", ids("abc"))[-1].finished == {"a": "stop"}
    out = await h.read_all("a")
    assert (out.text, out.stop_reason) == ("a", "bc")


async def test_held_text_and_bytes_are_released_when_length_finishes():
    h = Harness()
    h.add("a", max_tokens=3, stop=("hello",))
    h.run("a", ids("he") + [byte_token_id(0xE2), byte_token_id(0x82)])
    out = await h.read_all("a")
    assert out.finish_reason == "length"
    assert out.text == "he\ufffd"  # "he" was held (may start "hello"), E2 82 unfinished


def logprob_arrays(token_rows, value_rows, ranks) -> LogprobsArrays:
    return LogprobsArrays(np.array(token_rows, np.int64), np.array(value_rows, np.float32),
                          np.array(ranks, np.int64))


async def test_logprob_entries_are_floored_and_shaped_per_request():
    h = Harness(ByteLevelTokenBytes(tiny_tokenizer()))
    h.add("a", max_tokens=5, logprobs=2)
    h.add("b", max_tokens=5)  # no logprobs asked
    h.add("c", max_tokens=5, logprobs=0)
    x, y, z = ids("x")[0], ids("y")[0], ids("z")[0]
    e2 = byte_token_id(0xE2)
    arrays = logprob_arrays(
        [[x, y, e2, z], [y, x, z, e2], [e2, x, y, z]],
        [[-0.25, -1.5, -np.inf, np.nan], [-0.1, -2.0, -3.0, -4.0], [-1e6, np.nan, -2.0, -3.0]],
        [2, 1, 7])
    h.step({"a": x, "b": y, "c": e2}, logprobs=arrays)
    a, b, c = [await h.streams[r].get() for r in "abc"]
    assert b.logprobs is None
    (entry,) = a.logprobs
    assert (entry.token_id, entry.token, entry.bytes, entry.logprob, entry.rank) == (
        x, "x", (ord("x"),), -0.25, 2)
    assert [(t.token_id, t.logprob) for t in entry.top_logprobs] == [(y, -1.5), (e2, LOGPROB_FLOOR)]
    assert entry.top_logprobs[1].token == "\\xe2" and entry.top_logprobs[1].bytes == (0xE2,)
    (entry_c,) = c.logprobs
    assert entry_c.top_logprobs == ()
    assert (entry_c.token, entry_c.bytes, entry_c.logprob, entry_c.rank) == (
        "\\xe2", (0xE2,), LOGPROB_FLOOR, 7)
    assert c.text == ""  # the byte is held until its character completes
    for e in (entry, entry_c, *entry.top_logprobs):
        assert math.isfinite(e.logprob) and e.logprob >= LOGPROB_FLOOR


async def test_logprob_token_strings_without_token_bytes_come_from_decode():
    h = Harness()  # a plain tokenizers.Tokenizer has no token_bytes
    h.add("a", max_tokens=5, logprobs=1)
    w = ids(" w")[0]
    h.step({"a": w}, logprobs=logprob_arrays([[w, EOS]], [[-0.5, -0.7]], [1]))
    (entry,) = (await h.streams["a"].get()).logprobs
    assert (entry.token, entry.bytes) == (" w", (32, ord("w")))
    assert (entry.top_logprobs[0].token, entry.top_logprobs[0].token_id) == ("<eos>", EOS)


def test_floor_logprobs_never_returns_nan_or_inf():
    floored = floor_logprobs(np.array([np.nan, -np.inf, np.inf, -1e30, -3.5], np.float32))
    assert floored.tolist() == [LOGPROB_FLOOR, LOGPROB_FLOOR, 0.0, LOGPROB_FLOOR, -3.5]


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
    sched = run_sync(h.scheduler.schedule())
    tokens = {"r1": EOS, "r2": ids("b")[0], "r3": ids("a")[0]}
    out = StepOutput(sched.step_id, ("r1", "r2", "r3"),
                     np.array([tokens[r] for r in ("r1", "r2", "r3")], np.int64), None,
                     StepStats(sched.step_id, 3, 3, 0))
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
    sched = run_sync(h.scheduler.schedule())
    out = StepOutput(sched.step_id, ("a",), np.array([1, 2], np.int64), None,
                     StepStats(sched.step_id, 1, 1, 0))
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
    assert (await h.read_all("a")).error == "RuntimeError: cannot decode"


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
    assert h.processor.process_outputs(EngineCoreOutputs(1, ("a",), np.array([x], np.int32))) \
        == ["a"]
    # The core ran the next step before it heard the abort: its token is dropped.
    assert h.processor.process_outputs(EngineCoreOutputs(2, ("a",), np.array([y], np.int32))) \
        == []
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
    requests = [EngineRequest(rid, tuple(ids("Q:")), SamplingParams(max_tokens=5), 0.0, (EOS,))
                for rid in ("a", "b", "c")]
    streams = {r.request_id: RequestStream(r.request_id, 2) for r in requests}
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        for request in requests:
            actor.tell(RegisterRequest(request, streams[request.request_id]))
        actor.tell(EngineCoreOutputs(1, ("a", "b"), np.array([ids("x")[0], EOS], np.int32),
                                     finished=(RequestFinish("b", "stop"),)))
        actor.tell(AbortRequests(("a",)))
        actor.close()
    assert stopped == []  # the core ended b itself; a was aborted by its reader
    finals = {rid: [d async for d in s][-1] for rid, s in streams.items()}
    assert {rid: d.finish_reason for rid, d in finals.items()} == {
        "a": "abort", "b": "stop", "c": "abort"}
    with pytest.raises(TypeError, match="unexpected message"):
        await SamplerActor(h.processor, on_stopped=stopped.append).handle("nonsense")
