"""Session-wide hooks."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

_INTERPRETER = "tests.kernels._triton_interpreter"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Hands the order of the interpreted kernel checks that this session runs to
    tests/kernels/_triton_interpreter.py, which starts the next ones in its two children
    while a test waits for its own (only where the session has any: the module imports
    torch)."""
    functions = [getattr(item, "function", None) for item in session.items]
    if any(hasattr(function, "interpreted_check") for function in functions):
        from tests.kernels._triton_interpreter import plan_interpreted_checks

        plan_interpreted_checks(functions)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Checks started ahead that no test will ask for any more are dropped."""
    interpreter = sys.modules.get(_INTERPRETER)
    if interpreter is not None:
        interpreter.cancel_planned_checks()


def pytest_configure(config: pytest.Config) -> None:
    """Idle OpenMP threads sleep (gpu/cpu_threads.py): set before any test module imports
    torch, and inherited by the servers the tests start."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread_per_test_worker() -> Iterator[None]:
    """The test workers already keep every CPU busy: a second intra-op thread per worker
    only waits at barriers for a descheduled peer (on two CPUs the kernel, engine and
    offload tests ran 9% faster with one; the whole suite, mostly servers in their own
    processes, within its noise). An engine a test loads sets its own count, as a server's
    does."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    yield
