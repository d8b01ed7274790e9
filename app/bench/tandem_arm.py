"""One timed offline run of tandem's engine: every request submitted at t=0, as vLLM's
`bench throughput` does, with per-request first-token and finish times for TTFT/TPOT."""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

from actors.engine import Engine
from actors.messages import EngineRequest, StepStats
from actors.output_stream import RequestStream
from actors.sampling_params import SamplingParams
from app.llm import LLM


@dataclass(frozen=True, slots=True)
class RequestTiming:
    num_output_tokens: int
    ttft_s: float
    latency_s: float
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class EngineRun:
    elapsed_s: float
    requests: tuple[RequestTiming, ...]
    step_stats: tuple[StepStats, ...]
    num_preemptions: int

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)


def fixed_length_params(output_len: int) -> SamplingParams:
    """vLLM's throughput-benchmark sampling: T=1, top_p=1, ignore_eos, exact length."""
    return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len,
                          min_tokens=output_len, ignore_eos=True)


def run_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> EngineRun:
    """Run every prompt through a fresh engine on `llm`'s loaded model; wall time counts
    from the first submission to the last finish."""
    return anyio.run(_run, llm, prompts, params)


async def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> EngineRun:
    engine = Engine(llm.worker, llm.runner, llm.config)
    timings: list[RequestTiming | None] = [None] * len(prompts)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        started = time.monotonic()
        async with anyio.create_task_group() as requests_tg:
            for index, prompt in enumerate(prompts):
                request = EngineRequest(request_id=f"bench-{index}", prompt_token_ids=tuple(prompt),
                                        sampling_params=params, arrival_time=started)
                requests_tg.start_soon(_collect, engine.add_request(request), index, started,
                                       timings)
        elapsed_s = time.monotonic() - started
        engine.stop()
    requests = tuple(t for t in timings if t is not None)
    return EngineRun(elapsed_s, requests, engine.recent_step_stats(),
                     engine.stats().num_preemptions_total)


async def _collect(stream: RequestStream, index: int, started: float,
                   timings: list[RequestTiming | None]) -> None:
    num_tokens = 0
    first = finish = None
    reason = None
    async for delta in stream:
        num_tokens += len(delta.token_ids)
        first = delta.first_token_time or first
        finish = delta.finish_time or finish
        reason = delta.finish_reason or reason
    end = finish if finish is not None else time.monotonic()
    timings[index] = RequestTiming(num_tokens, (first or end) - started, end - started, reason)
