"""The output processor wired to a real scheduler and KV manager, driven step by step
(shared by tests/actors/test_sampler*.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.core.core_outputs import CoreOutputs
from actors.core.kv_cache_manager import KVCacheManager
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.frontend.output_stream import RequestStream, StreamDelta
from actors.frontend.sampler import OutputProcessor
from actors.protocol.messages import (
    EngineCoreOutputs,
    EngineRequest,
    LogprobsArrays,
    StepOutput,
    StepStats,
)
from actors.protocol.sampling_params import SamplingParams
from tests.actors._tokenizer_fixtures import tiny_tokenizer

EOS = 0  # "<eos>" in the tiny tokenizer
STOP_ID = 1  # "<stop>"


def ids(text: str) -> list[int]:
    return tiny_tokenizer().encode(text).ids


@dataclass
class Step:
    """What one step did, as a client-facing summary."""

    request_ids: tuple[str, ...]
    """Requests that got a token and still run, in batch order."""
    finished: dict[str, str]
    """Finish reason of each request this step ended (in the core or by a stop string)."""


class Harness:
    """The split pipeline on one thread: a real scheduler (the core's token-level stops),
    the core's per-step outputs, and the front end's OutputProcessor, with the aborts the
    front end sends back applied to the scheduler."""

    def __init__(self, tokenizer=None, max_model_len=256):
        manager = KVCacheManager(num_blocks=512, block_size=16)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=1024,
                max_model_len=max_model_len,
                block_size=16,
                max_steps_in_flight=1,
            ),
            manager,
        )
        self.sent: list[EngineCoreOutputs] = []
        self.core_outputs = CoreOutputs(lambda client, message: self.sent.append(message))
        self.processor = OutputProcessor(tokenizer or tiny_tokenizer())
        self.streams: dict[str, RequestStream] = {}

    def add(self, request_id: str, prompt: str = "Q:", **params) -> RequestStream:
        request = EngineRequest(
            request_id,
            tuple(ids(prompt)),
            SamplingParams(**params),
            arrival_time=0.0,
            eos_token_ids=(EOS,),
        )
        stream = RequestStream(request_id, num_prompt_tokens=len(request.prompt_token_ids))
        self.processor.add_request(request, stream)
        self.scheduler.add_request(request)
        self.streams[request_id] = stream
        return stream

    def step(
        self,
        tokens: dict[str, int],
        logprobs: LogprobsArrays | None = None,
        error: str | None = None,
        failed: tuple[str, ...] = (),
    ) -> Step:
        """Schedule a step, answer it with `tokens` (one per request that samples, in
        batch order), and push the outputs through the front end."""
        sched = self.scheduler.schedule()
        step_id = sched.step_id if sched is not None else -1
        sampled = (
            ()
            if sched is None
            else tuple(rid for rid, s in zip(sched.scheduled_request_ids, sched.samples_token) if s)
        )
        sampled = tuple(rid for rid in sampled if rid in tokens) if error is None else ()
        out = StepOutput(
            step_id,
            sampled,
            np.array([tokens[r] for r in sampled], np.int64),
            logprobs,
            StepStats(step_id, len(sampled), len(sampled), 0),
            error=error,
            failed_request_ids=failed,
        )
        before = {rid for rid, st in self.streams.items() if not st.finished}
        if sched is not None:
            self.core_outputs.step(out, self.scheduler.update_from_step(out))
        for message in self.sent:
            self.scheduler.abort_requests(self.processor.process_outputs(message))
        self.sent.clear()
        finished = {
            rid: self.streams[rid]._finish_reason for rid in before if self.streams[rid].finished
        }
        alive = tuple(rid for rid in sampled if rid not in finished and rid in before)
        return Step(alive, finished)

    def run(self, request_id: str, token_ids: list[int]) -> list[Step]:
        return [self.step({request_id: t}) for t in token_ids]

    async def read_all(self, request_id: str) -> StreamDelta:
        """Everything the client would have read, coalesced into one delta."""
        stream = self.streams[request_id]
        deltas = [d async for d in stream]
        logprobs = [e for d in deltas for e in (d.logprobs or ())]
        last = deltas[-1]
        return StreamDelta(
            request_id,
            tuple(t for d in deltas for t in d.token_ids),
            "".join(d.text for d in deltas),
            tuple(logprobs) if any(d.logprobs is not None for d in deltas) else None,
            last.finish_reason,
            last.stop_reason,
            last.error,
            last.num_prompt_tokens,
            last.num_cached_tokens,
            last.num_output_tokens,
            deltas[0].first_token_time,
            last.finish_time,
        )
