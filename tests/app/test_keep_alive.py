"""One clock pokes the quiet streams (and only those) for their keep-alive comments."""

from __future__ import annotations

import anyio

from actors.frontend.output_stream import RequestStream
from app.keep_alive import KeepAliveClock


async def test_quiet_streams_are_poked_and_busy_ones_are_not() -> None:
    clock = KeepAliveClock(0.2)
    quiet, busy = RequestStream("quiet", 1), RequestStream("busy", 1)
    seen: dict[str, list[bool]] = {"quiet": [], "busy": []}

    async def read(stream: RequestStream) -> None:
        with clock.watching(stream):
            while (delta := await stream.get()) is not None:
                seen[stream.request_id].append(delta.is_empty)
                if not delta.is_empty:
                    clock.sent(stream)

    async def feed() -> None:
        for _ in range(20):  # 1 s of tokens every 50 ms
            busy.push((1,), "x")
            await anyio.sleep(0.05)
        busy.push(finish_reason="length")
        quiet.push((1,), "x", finish_reason="length")

    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        async with anyio.create_task_group() as readers:
            readers.start_soon(read, quiet)
            readers.start_soon(read, busy)
            readers.start_soon(feed)
        tg.cancel_scope.cancel()
    assert seen["quiet"].count(True) >= 2 and seen["quiet"][-1] is False
    assert True not in seen["busy"]


def test_an_interval_of_zero_turns_the_clock_off() -> None:
    async def run() -> None:
        with anyio.fail_after(1):
            await KeepAliveClock(0).run()  # returns at once: nothing to do

    anyio.run(run)
