"""A captured function off CUDA, and the cycle collector held off around a capture."""

from __future__ import annotations

import gc

import pytest
import torch

from gpu.replayable import Replayable, cycle_collection_paused


def test_off_cuda_a_replayable_runs_its_function_each_time() -> None:
    calls: list[int] = []

    def fn() -> torch.Tensor:
        calls.append(1)
        return torch.full((2,), float(len(calls)))

    replayable = Replayable(fn, torch.device("cpu"), None)
    assert calls == [] and replayable.output is None
    assert replayable().tolist() == [1.0, 1.0] and replayable().tolist() == [2.0, 2.0]


def test_the_cycle_collector_is_held_off_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with cycle_collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), cycle_collection_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with cycle_collection_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
