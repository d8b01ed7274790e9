"""A response the client stops taking is cut after --send-timeout: the connection is
dropped with its buffered output and the request aborted in the engine. Its own server, as
the timeout here is short (tests/app/test_hostile_connections.py runs with the default)."""

from __future__ import annotations

import pytest

from tests.app._hostile import (
    STALLED,
    hostile,
    read_until_closed,
    small_send_buffer_server,
    stall,
    wait_until,
)

pytestmark = pytest.mark.slow


def test_a_response_the_client_stops_taking_is_cut_after_the_send_timeout() -> None:
    send_timeout_s = 2.0
    with small_send_buffer_server(send_timeout_s=send_timeout_s) as server, hostile(server.url):
        sock = stall(server, {**STALLED, "max_tokens": 1500, "min_tokens": 1500})
        wait_until(lambda: server.snapshot().num_unfinished_admitted == 1, 30, "not admitted")
        # Far sooner than the 1,500 tokens take: the writer stalls within ~100 kB.
        wait_until(
            lambda: server.snapshot().num_unfinished_admitted == 0,
            120,
            "the stalled response was never cut",
        )
        data = read_until_closed(sock)  # what reached the client before the cut, then the end
        assert data.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in data
        wait_until(
            lambda: (s := server.snapshot()).num_free_kv_blocks == s.num_total_kv_blocks,
            10,
            "the cut request's KV blocks were not freed",
        )  # it was aborted
