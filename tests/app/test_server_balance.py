"""Connections spread over the API servers of `tandem serve --api-server-count N`
(app/connection_balance.py): the shared connection counts tell a busier API server when to
give way and to whom not. (That a burst of long-lived connections lands evenly is tested on
a real server in tests/app/test_server_processes.py.)"""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

import pytest

from app.connection_balance import SLACK, STALE_AFTER_S, ConnectionLoads


def _tables(tmp_path: Path, count: int) -> list[ConnectionLoads]:
    path = str(tmp_path / "connection_loads")
    ConnectionLoads.create(path, count)
    return [ConnectionLoads(path, index) for index in range(count)]


def test_each_api_server_sees_the_others_connections_and_yields_only_beyond_the_slack(
    tmp_path: Path,
) -> None:
    first, second = _tables(tmp_path, 2)
    for _ in range(SLACK + 1):
        first.opened()
    assert second.open_connections(0) == SLACK + 1
    assert first.busier_than_a_live_peer() and not second.busier_than_a_live_peer()
    first.closed()
    assert not first.busier_than_a_live_peer(), "a difference of SLACK is even enough"
    second.opened()
    second.closed()
    assert first.open_connections(1) == 0


def test_a_peer_that_stopped_beating_is_not_yielded_to(tmp_path: Path) -> None:
    busy, silent = _tables(tmp_path, 2)
    for _ in range(SLACK + 3):
        busy.opened()
    assert busy.busier_than_a_live_peer()
    later = time.monotonic_ns() + int(STALE_AFTER_S * 1e9) + 1
    with mock.patch("time.monotonic_ns", return_value=later):
        busy.beat()  # only the busy one still beats
        assert not busy.busier_than_a_live_peer()
        silent.beat()
        assert busy.busier_than_a_live_peer()


def test_a_restarted_api_server_starts_from_no_connections(tmp_path: Path) -> None:
    dead, _ = _tables(tmp_path, 2)
    dead.opened()
    dead.opened()
    successor = ConnectionLoads(str(tmp_path / "connection_loads"), 0)
    assert successor.open_connections(0) == 0
    with pytest.raises(ValueError):
        ConnectionLoads(str(tmp_path / "connection_loads"), 2)
