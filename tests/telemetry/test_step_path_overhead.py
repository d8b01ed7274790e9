"""What the server's telemetry costs on the front end's step path: the sampler actor taking a
step's output with the server's hooks (metrics, the stats log, per-request timelines and
the scheduler-time bookkeeping) against none. Tracing has no step-path calls at all."""

from __future__ import annotations

import io
import logging
import time

import anyio
import numpy as np
import pytest
import structlog

from actors.frontend.output_stream import RequestStream
from actors.frontend.sampler import OutputProcessor, SamplerActor
from actors.protocol.messages import EngineCoreOutputs, EngineRequest, StepStats
from actors.protocol.sampling_params import SamplingParams
from telemetry.logging import EngineStatsLog
from telemetry.metrics import EngineMetrics


def _step_path_cost_us(with_telemetry: bool, batch_size: int, num_steps: int) -> float:
    """Microseconds per step for the sampler actor to take a step's output (tokens only,
    no tokenizer), with the server's telemetry hooks or none (tracing is off: it has no
    step-path calls at all)."""
    metrics = EngineMetrics("bench")
    info_logger = structlog.wrap_logger(
        structlog.PrintLogger(io.StringIO()),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    observers = [metrics.observe_step, EngineStatsLog(logger=info_logger).observe_step]
    processor = OutputProcessor(
        None, on_request_finished=(metrics.observe_request_finished if with_telemetry else None)
    )
    actor = SamplerActor(
        processor,
        on_stopped=lambda request_ids: None,
        step_observers=observers if with_telemetry else (),
    )
    request_ids = tuple(f"r{i}" for i in range(batch_size))
    for request_id in request_ids:
        processor.add_request(
            EngineRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=None), time.monotonic()),
            RequestStream(request_id, 3),
        )
    outputs = [
        EngineCoreOutputs(
            step,
            request_ids,
            np.full(batch_size, 7, np.int32),
            step_stats=StepStats(
                step, batch_size, batch_size, 0, step_time_s=1e-3, gpu_idle_s=1e-5
            ),
        )
        for step in range(num_steps)
    ]

    async def run() -> float:
        started = time.perf_counter()
        for out in outputs:
            await actor.handle(out)
        return time.perf_counter() - started

    return anyio.run(run) / num_steps * 1e6


@pytest.mark.parametrize("batch_size", [1, 64])
def test_telemetry_adds_little_to_the_step_path(batch_size: int) -> None:
    without, with_ = [], []
    for _ in range(5):  # interleaved, best of each: the machine is shared
        without.append(_step_path_cost_us(False, batch_size, 300))
        with_.append(_step_path_cost_us(True, batch_size, 300))
    overhead_us = min(with_) - min(without)
    print(
        f"\nstep path, batch {batch_size}: {min(without):.1f} us without telemetry, "
        f"{min(with_):.1f} us with, overhead {overhead_us:.1f} us/step"
    )
    assert overhead_us < 100 + 0.5 * min(without)
