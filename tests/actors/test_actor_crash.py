"""An actor that dies of a bug must end the engine, never leave its callers waiting."""

from __future__ import annotations

import threading

import pytest

from actors.core.scheduler import Scheduler
from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM

OPTIONS = dict(device="cpu", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)


def test_a_scheduler_bug_fails_generate_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("dummy:smollm2-135m", **OPTIONS)

    def broken(self: Scheduler, out: object) -> None:
        raise RuntimeError("injected scheduler bug")

    monkeypatch.setattr(Scheduler, "update_from_step", broken)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "generate hung after the scheduler actor died"
    assert outcome and outcome[0] is not None and "injected scheduler bug" in repr(outcome[0])
