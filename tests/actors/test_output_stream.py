from __future__ import annotations

import anyio
import pytest

from actors.frontend.output_stream import LogprobEntry, RequestStream, StreamDelta


def entry(token_id: int) -> LogprobEntry:
    return LogprobEntry(token_id, f"t{token_id}", (116,), -0.5, 1, ())


async def test_several_pushes_are_coalesced_into_one_delta():
    stream = RequestStream("r", num_prompt_tokens=7)
    stream.push([5], "He", [entry(5)], now=10.0)
    stream.push([6], "ll", [entry(6)], now=11.0)
    stream.push([7], "o", [entry(7)], now=12.0)
    delta = await stream.get()
    assert delta == StreamDelta(
        request_id="r",
        token_ids=(5, 6, 7),
        text="Hello",
        logprobs=(entry(5), entry(6), entry(7)),
        finish_reason=None,
        stop_reason=None,
        error=None,
        num_prompt_tokens=7,
        num_cached_tokens=0,
        num_output_tokens=3,
        first_token_time=10.0,
        finish_time=None,
    )
    stream.push([8], " you", [entry(8)], now=13.0)
    delta = await stream.get()
    assert (delta.token_ids, delta.text, delta.num_output_tokens) == ((8,), " you", 4)
    assert delta.first_token_time == 10.0


async def test_get_waits_for_the_next_push():
    stream = RequestStream("r", num_prompt_tokens=1)
    got: list[StreamDelta | None] = []

    async def reader() -> None:
        got.append(await stream.get())

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # nothing pending: the reader is parked
        stream.push([1], "a")
    assert got[0] is not None and got[0].text == "a"


async def test_a_slow_reader_gets_bigger_chunks_and_loses_nothing():
    stream = RequestStream("r", num_prompt_tokens=1)
    num_tokens = 60
    chunks: list[StreamDelta] = []

    async def slow_reader() -> None:
        async for delta in stream:
            chunks.append(delta)
            for _ in range(5):  # the client is slower than the engine
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(slow_reader)
        for i in range(num_tokens):
            stream.push([i], f"{i},")  # never blocks, whatever the reader does
            await anyio.lowlevel.checkpoint()
        stream.push(finish_reason="length")
    assert len(chunks) < num_tokens / 2
    assert [t for c in chunks for t in c.token_ids] == list(range(num_tokens))
    assert "".join(c.text for c in chunks) == "".join(f"{i}," for i in range(num_tokens))
    assert chunks[-1].finish_reason == "length"
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


async def test_final_delta_then_none_and_iteration_ends():
    stream = RequestStream("r", num_prompt_tokens=3)
    stream.set_num_cached_tokens(2)
    stream.push([4], "x", now=1.0)
    stream.push([9], "", finish_reason="stop", stop_reason=9, now=2.5)
    assert stream.finished
    delta = await stream.get()
    assert delta is not None and delta.finished
    assert (delta.token_ids, delta.finish_reason, delta.stop_reason) == ((4, 9), "stop", 9)
    assert (delta.first_token_time, delta.finish_time, delta.num_cached_tokens) == (1.0, 2.5, 2)
    assert await stream.get() is None
    assert await stream.get() is None
    assert [d async for d in stream] == []


async def test_pushes_after_the_finish_are_ignored():
    stream = RequestStream("r", num_prompt_tokens=1)
    stream.push([1], "a", finish_reason="abort")
    stream.push([2], "b")
    assert [d.token_ids async for d in stream] == [(1,)]


async def test_error_finish_carries_the_message():
    stream = RequestStream("r", num_prompt_tokens=1)
    stream.push(finish_reason="error", error="RuntimeError: device lost")
    delta = await stream.get()
    assert delta is not None
    assert (delta.finish_reason, delta.error, delta.token_ids, delta.text) == (
        "error",
        "RuntimeError: device lost",
        (),
        "",
    )
    assert delta.first_token_time is None and delta.finish_time is not None


async def test_logprobs_are_none_unless_pushed():
    stream = RequestStream("r", num_prompt_tokens=1)
    stream.push([1], "a")
    delta = await stream.get()
    assert delta is not None and delta.logprobs is None


async def test_aclose_drops_the_buffer_marks_cancelled_and_wakes_the_reader():
    stream = RequestStream("r", num_prompt_tokens=1)
    results: list[StreamDelta | None] = []

    async def reader() -> None:
        results.append(await stream.get())

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        await stream.aclose()
    assert results == [None]
    assert stream.cancelled
    stream.push([1], "late")  # the engine may still push until it sees `cancelled`
    assert await stream.get() is None


async def test_aclose_discards_pending_output():
    stream = RequestStream("r", num_prompt_tokens=1)
    stream.push([1, 2, 3], "abc")
    await stream.aclose()
    assert await stream.get() is None


@pytest.mark.parametrize("num_pushes", [1, 50])
async def test_buffer_holds_only_unread_output(num_pushes):
    stream = RequestStream("r", num_prompt_tokens=1)
    for i in range(num_pushes):
        stream.push([i], "x")
    delta = await stream.get()
    assert delta is not None and len(delta.token_ids) == num_pushes
    # What was read is gone: the next read only has what came after.
    stream.push([99], "y", finish_reason="length")
    delta = await stream.get()
    assert delta is not None and delta.token_ids == (99,) and delta.text == "y"


async def test_wait_finished_returns_the_whole_output_once_finished() -> None:
    stream = RequestStream("r", num_prompt_tokens=3)
    results = []

    async def reader() -> None:
        results.append(await stream.wait_finished())

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.sleep(0)
        stream.push((1,), "a")
        stream.push((2,), "b")
        await anyio.sleep(0.01)
        assert results == []  # per-step pushes do not complete the wait
        stream.push((3,), "c", finish_reason="length")
    (delta,) = results
    assert delta.token_ids == (1, 2, 3) and delta.text == "abc"
    assert delta.finish_reason == "length"
    assert await stream.get() is None


def test_observers_hear_of_the_first_token_and_the_finish_once_unread_or_not():
    """The admission actor counts engine capacity by what the engine did, not by what the
    reader has taken: nothing is read here."""
    events: list[tuple[str, str]] = []
    stream = RequestStream("r", num_prompt_tokens=3)
    stream.observe(
        lambda rid: events.append(("first", rid)), lambda rid: events.append(("finished", rid))
    )
    assert events == []
    stream.push([5], "a")
    stream.push([6], "b")
    stream.push([7], "c", finish_reason="length")
    stream.push([8], "d", finish_reason="stop")  # ignored: already finished
    assert events == [("first", "r"), ("finished", "r")]
    late: list[str] = []
    stream.observe(late.append, late.append)  # what already happened is reported at once
    assert late == ["r", "r"]
