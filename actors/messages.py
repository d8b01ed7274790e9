"""Every message that crosses an actor mailbox.

Messages are per request or per step, never per token per request: a step's results
travel as one message with arrays for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.sampling_params import SamplingParams


# ---- into the engine -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    arrival_time: float
    """time.monotonic() when the request reached the server."""
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    """Lower runs earlier (FCFS among equals)."""
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    """Tells the sampler actor where a request's output goes, before the request runs."""

    request: EngineRequest
    stream: Any
    """The request's actors.output_stream.RequestStream."""


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FinishRequests:
    """Scheduler -> sampler actor: requests the scheduler ended on its own (refused at
    admission, or a safety net), so their streams close with this reason."""

    reasons: tuple[tuple[str, str], ...]
    """(request_id, finish reason)."""
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PrefixCacheHits:
    """Scheduler -> sampler actor: prompt tokens served from the prefix cache at admission."""

    num_cached_tokens: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    request_id: str
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    queued_time: float
    """time.monotonic() when the scheduler queued the request."""
    first_scheduled_time: float
    """time.monotonic() when the request was first scheduled (prefill start)."""


@dataclass(frozen=True, slots=True)
class RequestsAdmitted:
    """Scheduler -> sampler actor, once per step that admits requests for the first time
    (never again after a preemption): what only the scheduler knows of their timeline."""

    requests: tuple[AdmittedRequest, ...]


# ---- scheduler -> GPU actor ------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request that takes a runner row: new, or resumed after preemption."""

    request_id: str
    token_ids: tuple[int, ...]
    """Prompt plus every output token generated before a preemption."""
    prompt_len: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    """Tokens already in the KV cache (prefix-cache hits)."""
    sampling_params: SamplingParams


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Diffs for requests that already hold a row."""

    request_ids: tuple[str, ...] = ()
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    """Blocks appended to each request's block table this step."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step_id: int
    new_requests: tuple[NewRequestData, ...]
    cached_requests: CachedRequestData
    scheduled_request_ids: tuple[str, ...]
    """Batch order."""
    num_scheduled_tokens: tuple[int, ...]
    """Tokens each scheduled request runs this step, aligned with scheduled_request_ids."""
    num_computed_tokens: tuple[int, ...]
    """Each scheduled request's computed tokens before this step (CPU mirror of GPU state)."""
    samples_token: tuple[bool, ...]
    """Whether this step's chunk reaches the end of the request's known tokens, so the
    sampled token is real (False for a partial prefill chunk)."""
    finished_request_ids: frozenset[str]
    """Rows to free before this step: finished, aborted or preempted requests."""
    schedule_time_s: float = 0.0
    """CPU time the scheduler spent building this step (copied into its StepStats)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled_request_ids)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_request_ids


# ---- GPU actor -> sampler actor ---------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LogprobsArrays:
    token_ids: np.ndarray  # [num_sampled, 1 + k] int64: sampled token first, then top-k
    logprobs: np.ndarray  # [num_sampled, 1 + k] float32
    sampled_rank: np.ndarray  # [num_sampled] int64, 1-based rank of the sampled token


@dataclass(frozen=True, slots=True)
class StepStats:
    step_id: int
    num_reqs: int
    num_tokens: int
    num_prefill_tokens: int
    schedule_time_s: float = 0.0
    """CPU time the scheduler spent building this step."""
    prepare_time_s: float = 0.0
    """CPU time from receiving the step to the last launch."""
    step_time_s: float = 0.0
    """Device time of the step, measured with events where the device allows."""
    gpu_idle_s: float = 0.0
    """Device idle time between the previous step's end and this step's start."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    step_id: int
    request_ids: tuple[str, ...]
    """Requests that sampled a real token this step, in batch order."""
    sampled_token_ids: np.ndarray  # [len(request_ids)] int64
    logprobs: LogprobsArrays | None
    """Rows aligned with request_ids; None when no request asked for logprobs."""
    stats: StepStats
    error: str | None = None
    """Set when the step failed; every request in it is finished with reason 'error'."""
    failed_request_ids: tuple[str, ...] = ()


# ---- sampler actor -> scheduler -------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StepUpdate:
    """The scheduler's view of a finished step: tokens to append, requests to finish."""

    step_id: int
    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[int, ...]
    finished: dict[str, str] = field(default_factory=dict)
    """request_id -> finish reason ('stop', 'length', 'abort', 'error')."""
