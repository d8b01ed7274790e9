"""Output processing: EOS, stop ids, min/max tokens, stop strings and logprobs, each
decided where it belongs (the core or the front end)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.frontend.logprob_text import LOGPROB_FLOOR, floor_logprobs
from actors.protocol.messages import LogprobsArrays
from tests.actors._sampler_harness import EOS, STOP_ID, Harness, ids
from tests.actors._tokenizer_fixtures import ByteLevelTokenBytes, byte_token_id, tiny_tokenizer


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
    return LogprobsArrays(
        np.array(token_rows, np.int64), np.array(value_rows, np.float32), np.array(ranks, np.int64)
    )


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
        [2, 1, 7],
    )
    h.step({"a": x, "b": y, "c": e2}, logprobs=arrays)
    a, b, c = [await h.streams[r].get() for r in "abc"]
    assert b.logprobs is None
    (entry,) = a.logprobs
    assert (entry.token_id, entry.token, entry.bytes, entry.logprob, entry.rank) == (
        x,
        "x",
        (ord("x"),),
        -0.25,
        2,
    )
    assert [(t.token_id, t.logprob) for t in entry.top_logprobs] == [(y, -1.5), (e2, LOGPROB_FLOOR)]
    assert entry.top_logprobs[1].token == "\\xe2" and entry.top_logprobs[1].bytes == (0xE2,)
    (entry_c,) = c.logprobs
    assert entry_c.top_logprobs == ()
    assert (entry_c.token, entry_c.bytes, entry_c.logprob, entry_c.rank) == (
        "\\xe2",
        (0xE2,),
        LOGPROB_FLOOR,
        7,
    )
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
