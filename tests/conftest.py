"""Session-wide hooks."""

from __future__ import annotations

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """Hands the order of the interpreted kernel checks that this session runs to
    tests/kernels/_triton_interpreter.py, which starts the next one in a second child while
    a test waits for its own (only where the session has any: the module imports torch)."""
    functions = [getattr(item, "function", None) for item in session.items]
    if any(hasattr(function, "interpreted_check") for function in functions):
        from tests.kernels._triton_interpreter import plan_interpreted_checks

        plan_interpreted_checks(functions)
