"""Fixtures shared by the server tests in this folder."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.app._server_fixtures import RunningServer


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    """A client on the test module's `server` fixture."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
