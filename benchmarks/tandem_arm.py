"""One timed offline run of tandem's engine: every request submitted at t=0, as vLLM's
`bench throughput` does, with per-request first-token and finish times for TTFT/TPOT."""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

from actors.inprocess_engine import InProcessEngine
from actors.protocol.messages import EngineRequest, StepStats
from actors.frontend.output_stream import RequestStream, StreamDelta
from actors.protocol.sampling_params import SamplingParams
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
    engine = InProcessEngine(llm.worker, llm.loaded.runner, llm.config, tokenizer=llm.tokenizer)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        started = time.monotonic()
        streams = [engine.add_request(EngineRequest(
            request_id=f"bench-{index}", prompt_token_ids=tuple(prompt), sampling_params=params,
            arrival_time=started)) for index, prompt in enumerate(prompts)]
        timings = await _collect_finished(streams, started)
        elapsed_s = time.monotonic() - started
        engine.stop()
    return EngineRun(elapsed_s, tuple(timings), engine.recent_step_stats(),
                     engine.num_preemptions_total)


async def _collect_finished(streams: list[RequestStream], started: float) -> list[RequestTiming]:
    """Read each stream once, after it has finished, as vLLM's offline `generate` returns
    whole outputs. Reading every step instead would wake one task per request per step,
    CPU time the engine's own threads then lack. The timestamps are the stream's own (set
    when the engine pushed), so reading late does not blur TTFT or latency."""
    timings: list[RequestTiming | None] = [None] * len(streams)

    async def read(index: int) -> None:
        timings[index] = _timing(await streams[index].wait_finished(), started)

    async with anyio.create_task_group() as tg:
        for index in range(len(streams)):
            tg.start_soon(read, index)
    return [t for t in timings if t is not None]


def _timing(delta: StreamDelta | None, started: float) -> RequestTiming:
    if delta is None:
        return RequestTiming(0, 0.0, 0.0, None)
    end = delta.finish_time if delta.finish_time is not None else time.monotonic()
    first = delta.first_token_time if delta.first_token_time is not None else end
    return RequestTiming(delta.num_output_tokens, first - started, end - started,
                         delta.finish_reason)
