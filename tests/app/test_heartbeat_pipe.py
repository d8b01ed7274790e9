"""The supervisor's judgement of an API server's heartbeats: silence beyond the bound
counts, any byte read ends it, bytes that waited in the pipe count when read, and before
the first heartbeat the start grace applies."""

from __future__ import annotations

import os

import anyio

from app.heartbeat_pipe import START_GRACE_S, HeartbeatReader, send_heartbeats


def _reader(stall_timeout_s: float, started_at: float = 100.0) -> tuple[HeartbeatReader, int]:
    read_fd, write_fd = os.pipe()
    return HeartbeatReader(read_fd, started_at, stall_timeout_s), write_fd


def test_silence_beyond_the_bound_counts_until_a_heartbeat_is_read() -> None:
    reader, write_fd = _reader(2.0)
    try:
        os.write(write_fd, b".")
        reader.read(101.0)
        assert not reader.is_silent_too_long(103.0)
        reader.read(103.5)  # nothing came
        assert reader.is_silent_too_long(103.5) and reader.silent_s(103.5) == 2.5
        os.write(write_fd, b"..")  # waited in the pipe while the supervisor was late
        reader.read(110.0)
        assert not reader.is_silent_too_long(110.0)
    finally:
        reader.close()
        os.close(write_fd)


def test_before_the_first_heartbeat_the_start_grace_applies() -> None:
    reader, write_fd = _reader(2.0, started_at=100.0)
    try:
        reader.read(100.0 + START_GRACE_S)
        assert not reader.is_silent_too_long(100.0 + START_GRACE_S)
        assert reader.is_silent_too_long(100.1 + START_GRACE_S)
    finally:
        reader.close()
        os.close(write_fd)


def test_a_zero_bound_never_judges() -> None:
    reader, write_fd = _reader(0.0)
    try:
        assert not reader.is_silent_too_long(100.0 + 10 * START_GRACE_S)
    finally:
        reader.close()
        os.close(write_fd)


async def test_the_sender_beats_until_cancelled_and_closes_its_end() -> None:
    read_fd, write_fd = os.pipe()
    try:
        with anyio.move_on_after(1.2):
            await send_heartbeats(write_fd)
        received = os.read(read_fd, 100)
        assert received.startswith(b"..") and set(received) == {ord(".")}
        assert os.read(read_fd, 100) == b""  # then end of file: the sender closed its end
    finally:
        os.close(read_fd)
