"""What an engine core tells each front end of its load (CoreLoad, with every step's outputs):
its running and waiting requests, and how many of that front end's requests it has taken
in, so that a balancer over several cores knows which of its requests are still on their
way."""

from __future__ import annotations

import time

import anyio
import pytest

from actors.core.engine_startup import reuse_engine
from actors.inprocess_engine import InProcessEngine
from actors.protocol.messages import CoreLoad, EngineRequest
from actors.protocol.sampling_params import SamplingParams
from tests.app._server_fixtures import ENGINE, shared_model

pytestmark = pytest.mark.slow

CONFIG = ENGINE.replace(max_num_seqs=2, max_num_batched_tokens=64)


def test_every_step_tells_the_load_and_what_was_taken_in() -> None:
    loaded = reuse_engine(shared_model(), CONFIG)
    loads: list[CoreLoad] = []

    async def run() -> None:
        engine = InProcessEngine(loaded.worker, loaded.runner, CONFIG, on_load=loads.append)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            streams = [
                engine.add_request(EngineRequest(f"r{i}", (i + 1,) * 8, params, time.monotonic()))
                for i in range(5)
            ]
            for stream in streams:
                await stream.wait_finished()
            engine.stop()

    anyio.run(run)
    assert loads, "no step carried the core's load"
    assert max(load.num_running for load in loads) == CONFIG.max_num_seqs
    assert max(load.num_running + load.num_waiting for load in loads) == 5
    assert all(load.num_received == 5 for load in loads)  # all arrived before the first step
    assert (loads[-1].num_running, loads[-1].num_waiting) == (0, 0)
