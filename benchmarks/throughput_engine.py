"""One timed pass of benchmarks.throughput's prompts through a fresh in-process engine: every
request submitted at t=0 with vLLM's throughput sampling, each request's first-token and
finish times from its stream, and every step's statistics from the step observers."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any


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
    steps: tuple[Any, ...]
    """Every step's StepStats, as the engine client's step observers saw them."""
    num_preemptions: int | None

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)


def fixed_length_params(output_len: int) -> Any:
    """vLLM's throughput-benchmark sampling: T=1, top_p=1, ignore_eos, exact length."""
    from actors.protocol.sampling_params import SamplingParams

    return SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True
    )


def run_engine(llm: Any, prompts: list[list[int]], params: Any) -> EngineRun:
    """Run every prompt through a fresh engine on `llm`'s loaded model (app.llm.LLM)."""
    import anyio

    return anyio.run(_run_engine, llm, prompts, params)


async def _run_engine(llm: Any, prompts: list[list[int]], params: Any) -> EngineRun:
    import anyio

    from actors.inprocess_engine import InProcessEngine
    from actors.protocol.messages import EngineRequest

    steps: list[Any] = []
    preemptions: list[int] = []
    engine = InProcessEngine(
        llm.worker,
        llm.loaded.runner,
        llm.config,
        tokenizer=llm.tokenizer,
        step_observers=[steps.append],
        on_scheduler_stats=lambda stats: preemptions.append(stats.num_preemptions_total),
    )
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        started = time.monotonic()
        streams = [
            engine.add_request(
                EngineRequest(
                    request_id=f"bench-{index}",
                    prompt_token_ids=tuple(prompt),
                    sampling_params=params,
                    arrival_time=started,
                )
            )
            for index, prompt in enumerate(prompts)
        ]
        timings = await _collect_finished(streams, started)
        elapsed_s = time.monotonic() - started
        engine.stop()
    # Each engine starts a fresh scheduler: its running total is this run's count.
    return EngineRun(
        elapsed_s, tuple(timings), tuple(steps), preemptions[-1] if preemptions else None
    )


async def _collect_finished(streams: list[Any], started: float) -> list[RequestTiming]:
    """Read each stream once, after it has finished, as vLLM's offline `generate` returns
    whole outputs. Reading every step instead would wake one task per request per step,
    CPU time the engine's own threads then lack. The timestamps are the stream's own (set
    when the engine pushed), so reading late does not blur TTFT or latency."""
    import anyio

    timings: list[RequestTiming | None] = [None] * len(streams)

    async def read(index: int) -> None:
        delta = await streams[index].wait_finished()
        if delta is None:
            timings[index] = RequestTiming(0, 0.0, 0.0, None)
            return
        end = delta.finish_time if delta.finish_time is not None else time.monotonic()
        first = delta.first_token_time if delta.first_token_time is not None else end
        timings[index] = RequestTiming(
            delta.num_output_tokens, first - started, end - started, delta.finish_reason
        )

    async with anyio.create_task_group() as tg:
        for index in range(len(streams)):
            tg.start_soon(read, index)
    return [t for t in timings if t is not None]


def free_device_memory() -> None:
    """What closed engines held on the device (their KV cache, CUDA graphs) back to it: the
    engines' actors and runners hold reference cycles, and torch's allocator keeps freed
    blocks cached."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
