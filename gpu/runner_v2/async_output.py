"""How the CPU learns a step's sampled tokens without stalling the device stream.

The copies run on a side stream that waits for the main stream, and an event marks their
end; `result()` blocks on that event only, so the main stream can already be running the
next step. Non-blocking device-to-host copies land in freshly pinned host tensors, so no
buffer the CPU writes is ever read by an in-flight copy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch

from actors.protocol.messages import LogprobsArrays, PromptLogprobs, StepOutput, StepStats
from gpu.sampling.sampler import SamplerOutput

CopyT = TypeVar("CopyT", bound=Any)


@dataclass(slots=True)
class StepCopy:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64, host
    logprob_token_ids: torch.Tensor | None  # [num_reqs, 1 + k], host
    logprobs: torch.Tensor | None  # [num_reqs, 1 + k] float32, host
    sampled_ranks: torch.Tensor | None  # [num_reqs], host

    @classmethod
    def of(cls, sampled: SamplerOutput) -> StepCopy:
        return cls(
            sampled.sampled_token_ids,
            sampled.logprob_token_ids,
            sampled.logprobs,
            sampled.sampled_ranks,
        )


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Timing events a step recorded on the main stream: at its first and last launch, and
    the previous step's last one. All have completed once the step's outputs have."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    previous_end: torch.cuda.Event | None

    def stats(self, stats: StepStats) -> StepStats:
        """`stats` with the device step time and the idle gap before the step filled in."""
        idle_s = 0.0
        if self.previous_end is not None:
            # Same stream: the start ran after the previous end, so the gap is device idle
            # time spent waiting for this step's first launch.
            idle_s = max(self.previous_end.elapsed_time(self.start), 0.0) / 1e3
        return msgspec.structs.replace(
            stats, step_time_s=self.start.elapsed_time(self.end) / 1e3, gpu_idle_s=idle_s
        )


class PendingStep:
    """A launched step; `result()` waits for its outputs and packs a StepOutput."""

    def __init__(
        self,
        step_id: int,
        request_ids: tuple[str, ...],
        samples_token: np.ndarray,
        copy: StepCopy | Callable[[], StepCopy],
        event: torch.cuda.Event | None,
        stats: StepStats,
        timing: StepTiming | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        self.step_id = step_id
        self.request_ids = request_ids
        self._samples_token = samples_token  # [num_reqs] bool
        self._copy = copy
        self._event = event
        self._stats = stats
        self._timing = timing
        self._prompt_logprobs = prompt_logprobs
        self.launched_at = time.perf_counter()

    def result(self) -> StepOutput:
        if self._event is not None:
            self._event.synchronize()
        # A first pipeline stage's tokens come from the last stage: waited for here (the
        # step's timing events are behind the same wait).
        copy = self._copy if isinstance(self._copy, StepCopy) else self._copy()
        if self._timing is not None:
            self._stats = self._timing.stats(self._stats)
        keep = self._samples_token
        request_ids = tuple(r for r, k in zip(self.request_ids, keep) if k)
        sampled = copy.sampled_token_ids.numpy()[keep]
        logprobs = None
        if copy.logprobs is not None:
            logprobs = LogprobsArrays(
                token_ids=copy.logprob_token_ids.numpy()[keep],
                logprobs=copy.logprobs.numpy()[keep],
                sampled_rank=copy.sampled_ranks.numpy()[keep],
            )
        return StepOutput(
            step_id=self.step_id,
            request_ids=request_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            stats=self._stats,
            prompt_logprobs=self._prompt_logprobs,
        )


def copy_to_host(
    tensors: CopyT, copy_stream: torch.cuda.Stream | None
) -> tuple[CopyT, torch.cuda.Event | None]:
    """`tensors` (a dataclass of device tensors or None) copied to the host on the side
    stream, and the event that marks the copies' end."""
    if copy_stream is None:  # CPU: the tensors already live on the host
        return tensors, None
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        values = (getattr(tensors, f.name) for f in dataclasses.fields(tensors))
        host = type(tensors)(*(None if t is None else _to_host(t, copy_stream) for t in values))
        event = torch.cuda.Event()
        event.record(copy_stream)
    return host, event


def _to_host(tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    tensor.record_stream(stream)  # keep the allocator from reusing it before the copy ends
    return tensor.to("cpu", non_blocking=True)
