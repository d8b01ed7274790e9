"""Session-wide hooks."""

from __future__ import annotations

import sys

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
