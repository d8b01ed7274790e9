"""Fixtures of the tests that spawn tensor- or pipeline-parallel ranks."""

from __future__ import annotations

import pytest


@pytest.fixture
def ranks_wait_passively(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned ranks inherit the environment: OpenMP threads that spin while they wait
    take the cores the other ranks need, which on a machine of two cores slows every
    collective several times over."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
