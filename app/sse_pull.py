"""The pull side of a streamed response: reads the admitted group's choices and hands the
SSE writer batches. Each read takes everything a choice accumulated since the last one and
sends it in one write, so a slow client gets bigger chunks and never holds the engine back.
Separate from app/sse.py because it knows streams and timers, not HTTP or the wire format."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from actors.frontend.admitted_group import AdmittedGroup
from actors.frontend.output_stream import StreamDelta
from app.keep_alive import KeepAliveClock

Batch = list[tuple[int, StreamDelta]]


async def pull_batches(
    group: AdmittedGroup,
    keep_alive: KeepAliveClock,
    on_batch: Callable[[Batch], Awaitable[bool]],
    on_quiet: Callable[[], Awaitable[None]],
) -> bool:
    """Feed `on_batch` with everything the group's streams accumulated, until every stream
    ended or `on_batch` returns True (then True is returned). `on_quiet` runs whenever
    nothing arrived for the clock's interval."""
    if len(group.streams) == 1:
        return await _pull_single(group, keep_alive, on_batch, on_quiet)
    keep_alive_s = keep_alive.interval_s
    send_stream, receive_stream = anyio.create_memory_object_stream[tuple[int, StreamDelta]](0)

    async def read_choice(index: int, sender: Any) -> None:
        async with sender:
            while (delta := await group.get(index)) is not None:
                await sender.send((index, delta))

    async with anyio.create_task_group() as tg:
        async with send_stream:
            for index in range(len(group.streams)):
                tg.start_soon(read_choice, index, send_stream.clone())
        failed = await _drain_merged(receive_stream, keep_alive_s, on_batch, on_quiet)
        tg.cancel_scope.cancel()
    return failed


async def _pull_single(
    group: AdmittedGroup,
    keep_alive: KeepAliveClock,
    on_batch: Callable[[Batch], Awaitable[bool]],
    on_quiet: Callable[[], Awaitable[None]],
) -> bool:
    stream = group.streams[0]
    with keep_alive.watching(stream):
        while (delta := await group.get(0)) is not None:
            if delta.is_empty:  # poked by the clock: quiet for its interval
                await on_quiet()
                continue
            keep_alive.sent(stream)
            if await on_batch([(0, delta)]):
                return True
    return False


async def _drain_merged(
    receive_stream: Any,
    keep_alive_s: float,
    on_batch: Callable[[Batch], Awaitable[bool]],
    on_quiet: Callable[[], Awaitable[None]],
) -> bool:
    async with receive_stream:
        while True:
            first = None
            with anyio.move_on_after(_interval(keep_alive_s)) as waited:
                try:
                    first = await receive_stream.receive()
                except anyio.EndOfStream:
                    return False
            if waited.cancelled_caught:
                await on_quiet()
                continue
            batch = [first]
            while True:
                try:
                    batch.append(receive_stream.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            if await on_batch(batch):
                return True


def _interval(keep_alive_s: float) -> float:
    return keep_alive_s if keep_alive_s > 0 else math.inf
