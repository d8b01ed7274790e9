"""Fixtures shared by the server tests in this folder."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests._command_batch import CommandBatch
from tests.app._server_fixtures import RunningServer


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    """A client on the test module's `server` fixture."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tmp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the test module's files (the CLI modules' `_commands` write there)."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp: Path) -> Iterator[CommandBatch]:
    """The module's `_commands(tmp)` of the selected tests, started together
    (tests/_command_batch.py)."""
    with CommandBatch.of_selected(request, request.module._commands(tmp)) as batch:
        yield batch


@pytest.fixture
def result(runs: CommandBatch, request: pytest.FixtureRequest) -> subprocess.CompletedProcess[str]:
    """The run of the requesting test's command."""
    return runs.result(request.node.name)
