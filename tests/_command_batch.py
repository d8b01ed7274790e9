"""The subprocess runs of one test module (`python -m app.cli ...` and the like), started
together when its first test asks for one and run two at a time; each test then asserts on
its own run's result.

Most of such a run is one core importing torch and the product or loading the model, while
pytest waits; two at a time keeps both of the CI machine's cores busy. Each command runs
as its test would run it (arguments, environment, working directory, time-out); only the
runs of the tests that this session selected start.

    @pytest.fixture(scope="module")
    def runs(request):
        with CommandBatch.of_selected(request, {"test_x": cli("--help")}) as batch:
            yield batch

    def test_x(runs, request):
        result = runs.result(request.node.name)   # the CompletedProcess of its command
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

NUM_PARALLEL_RUNS = 2
"""The CI machine's cores."""


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    env: Mapping[str, str] | None = None
    """The whole environment (None: this process's)."""
    timeout_s: float = 300.0
    cwd: Path | None = None
    """None: pytest's own working directory."""

    def run(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(self.argv),
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            cwd=self.cwd,
            env=None if self.env is None else dict(self.env),
        )


def cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    cwd: Path | None = None,
) -> Command:
    """`python -m app.cli *args`, with `env` added to this process's environment."""
    return Command(
        (sys.executable, "-m", "app.cli", *args),
        env=None if env is None else {**os.environ, **env},
        timeout_s=timeout_s,
        cwd=cwd,
    )


class CommandBatch:
    """Named commands, all submitted at once to NUM_PARALLEL_RUNS worker threads, in the
    order given (put the longest first)."""

    def __init__(self, commands: Mapping[str, Command]) -> None:
        self._pool = ThreadPoolExecutor(NUM_PARALLEL_RUNS, thread_name_prefix="command-batch")
        self._runs: dict[str, Future[subprocess.CompletedProcess[str]]] = {
            name: self._pool.submit(command.run) for name, command in commands.items()
        }

    @classmethod
    def of_selected(
        cls, request: pytest.FixtureRequest, commands: Mapping[str, Command]
    ) -> CommandBatch:
        """The commands named after a test of the requesting module that this session runs:
        a name is the test's name (`test_x[id]`), or that, ':' and a suffix."""
        module = request.node.path
        selected = {item.name for item in request.session.items if item.path == module}
        return cls({name: c for name, c in commands.items() if name.split(":")[0] in selected})

    def result(self, name: str) -> subprocess.CompletedProcess[str]:
        """The run's result (raises what the run raised, e.g. its time-out)."""
        return self._runs[name].result()

    def __enter__(self) -> CommandBatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
