"""The admission actor: the gate between the HTTP routes and the engine.

Routes ask it to admit one API request (all of its samples and prompts at once, or none).
It checks per-request limits (400), refuses with 429 when the engine's waiting queue is
full (by requests or by prompt tokens still to prefill) and with 503 while the server
drains, otherwise adds the requests to the engine. It tracks every admitted request until
its reader has seen the final output or gave up, so the server knows when it is idle.

Queue model: the engine runs at most `max_num_running` requests at once, so requests in the
engine beyond that number are waiting. A request leaves the engine when its final outcome
arrives, whether or not its client has read it: output still being sent to a slow client
is not engine capacity (`num_unsent` counts such requests). A request counts as "queued
prompt tokens" until its first output token arrives (it is waiting or still prefilling).
The request's output stream reports both events (first token, final outcome).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, assert_never

import anyio

from actors.frontend.admitted_group import AdmittedGroup
from actors.frontend.output_stream import RequestStream
from actors.protocol.mailbox import Actor, ActorStopped
from actors.protocol.messages import (
    AbortAll,
    Admit,
    BeginDrain,
    EngineDone,
    EngineRequest,
    FailAll,
    Finished,
    GetAdmissionStats,
    ResumeAdmission,
    Started,
    ToAdmission,
    WaitIdle,
)
from actors.protocol.sampling_params import SamplingParams

_SEED_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_num_running: int
    """The engine's max_num_seqs: admitted requests beyond this many are waiting."""
    max_queued_requests: int = 1024
    """Most requests waiting at once; more are refused with 429."""
    max_queued_prompt_tokens: int | None = None
    """Most prompt tokens of admitted requests without a first token yet (None: no limit).
    A request is always admitted when nothing is queued, however long its prompt."""
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_logit_bias_entries: int = 300
    retry_after_s: int = 1
    """Retry-After (seconds) on 429 and on 503 while draining."""

    def __post_init__(self) -> None:
        if self.max_num_running < 1:
            raise ValueError(f"max_num_running must be at least 1, got {self.max_num_running}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_queued_prompt_tokens is not None and self.max_queued_prompt_tokens < 1:
            raise ValueError("max_queued_prompt_tokens must be at least 1 (or unset)")


class RequestLimitError(ValueError):
    """A request exceeds a per-request limit (HTTP 400); `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class AdmissionRefused(Exception):
    """The request is well formed but cannot be taken now (429 overloaded, 503 draining)."""

    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


class EngineLike(Protocol):
    def add_request(self, request: EngineRequest) -> RequestStream: ...

    def abort(self, request_ids: list[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    num_unfinished: int
    """Admitted requests whose reader has not seen the end yet."""
    num_unsent: int
    """Of those, the requests the engine has finished (their output is still being sent)."""
    num_queued: int
    num_queued_prompt_tokens: int
    num_admitted_total: int
    num_refused_total: int
    draining: bool


@dataclass(slots=True)
class _Entry:
    stream: RequestStream
    num_prompt_tokens: int
    started: bool = False
    in_engine: bool = True


@dataclass(slots=True)
class _State:
    entries: dict[str, _Entry] = field(default_factory=dict)
    num_in_engine: int = 0
    num_unstarted_prompt_tokens: int = 0
    num_admitted_total: int = 0
    num_refused_total: int = 0
    draining: bool = False
    failed_message: str | None = None
    unresponsive_message: str | None = None
    """Set while the engine core is silent after a retryable FailAll."""
    idle_waiters: list[anyio.Event] = field(default_factory=list)


class AdmissionActor(Actor[ToAdmission]):
    name = "admission"

    def __init__(self, engine: EngineLike, limits: AdmissionLimits) -> None:
        super().__init__()
        self._engine = engine
        self.limits = limits
        self._state = _State()

    # ---- caller side ------------------------------------------------------------------

    async def admit(
        self, requests: Sequence[EngineRequest], params: SamplingParams
    ) -> AdmittedGroup:
        """Admit all `requests` or raise RequestLimitError / AdmissionRefused."""
        streams = await self.ask(Admit(tuple(requests), params))
        assert isinstance(streams, list)
        return AdmittedGroup(self.release, streams)

    def release(self, request_ids: tuple[str, ...], abort: bool = False) -> None:
        """Their readers are done (`abort`: gave up early; abort what still runs)."""
        self.tell(Finished(request_ids, abort))

    async def stats(self) -> AdmissionStats:
        stats = await self.ask(GetAdmissionStats())
        assert isinstance(stats, AdmissionStats)
        return stats

    async def wait_idle(self) -> None:
        idle = anyio.Event()
        self.tell(WaitIdle(idle))
        await idle.wait()

    async def wait_idle_or(self, force: anyio.Event, timeout_s: float) -> bool:
        """True once no admitted request is left; False on timeout or when `force` is set."""
        idle = False
        with anyio.move_on_after(timeout_s):
            async with anyio.create_task_group() as tg:

                async def wait_idle() -> None:
                    nonlocal idle
                    await self.wait_idle()
                    idle = True
                    tg.cancel_scope.cancel()

                async def wait_force() -> None:
                    await force.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(wait_idle)
                tg.start_soon(wait_force)
        return idle

    def fail_streams(self, message: str) -> None:
        """End every admitted stream with an error once the engine (and this actor's task
        with it) has died; nothing else is left to deliver their outputs."""
        self._fail_all(message)

    # ---- actor side -------------------------------------------------------------------

    async def handle(self, message: ToAdmission) -> object:
        match message:
            case Admit():
                return self._admit(message)
            case Started():
                self._mark_started(message.request_ids)
            case EngineDone():
                self._mark_engine_done(message.request_ids)
            case Finished():
                self._finish(message.request_ids, message.abort)
            case GetAdmissionStats():
                return self._stats()
            case WaitIdle():
                self._state.idle_waiters.append(message.idle)
            case BeginDrain():
                self._state.draining = True
            case AbortAll():
                self._engine.abort(list(self._state.entries))
            case FailAll():
                admitted = list(self._state.entries)
                self._fail_all(message.message, message.retryable)
                # Their streams have ended: free their KV now, or, from a core that stopped
                # answering, once it reads the abort (its late outputs for them are dropped).
                self._engine.abort(admitted)
            case ResumeAdmission():
                self._state.unresponsive_message = None
            case _:
                assert_never(message)
        return None

    async def on_idle(self) -> None:
        if not self._state.entries and self._state.idle_waiters:
            for event in self._state.idle_waiters:
                event.set()
            self._state.idle_waiters.clear()

    def _admit(self, message: Admit) -> list[RequestStream]:
        check_request_limits(message.sampling_params, self.limits)
        state = self._state
        if state.failed_message is not None:
            raise AdmissionRefused(
                503,
                "The engine has stopped; the server cannot take requests",
                self.limits.retry_after_s,
            )
        if state.draining:
            raise AdmissionRefused(
                503,
                "The server is shutting down; retry on another replica",
                self.limits.retry_after_s,
            )
        if state.unresponsive_message is not None:
            raise AdmissionRefused(503, state.unresponsive_message, self.limits.retry_after_s)
        self._check_capacity(message.requests)
        streams = []
        for request in message.requests:
            stream = self._engine.add_request(request)
            num_prompt_tokens = len(request.prompt_token_ids)
            state.entries[request.request_id] = _Entry(stream, num_prompt_tokens)
            state.num_in_engine += 1
            state.num_unstarted_prompt_tokens += num_prompt_tokens
            stream.observe(self._report_first_token, self._report_engine_done)
            streams.append(stream)
        state.num_admitted_total += len(message.requests)
        return streams

    def _check_capacity(self, requests: Sequence[EngineRequest]) -> None:
        limits, state = self.limits, self._state
        num_new = len(requests)
        capacity = limits.max_num_running + limits.max_queued_requests
        if num_new > capacity:
            raise RequestLimitError(
                "n",
                f"this request needs {num_new} sequences; the server "
                f"holds at most {capacity} at once",
            )
        num_queued = max(0, state.num_in_engine + num_new - limits.max_num_running)
        if num_queued > limits.max_queued_requests:
            self._refuse(
                f"The server is overloaded: {limits.max_queued_requests} requests are "
                "already waiting; retry later"
            )
        token_limit = limits.max_queued_prompt_tokens
        new_tokens = sum(len(r.prompt_token_ids) for r in requests)
        queued_tokens = state.num_unstarted_prompt_tokens
        if (
            token_limit is not None
            and queued_tokens > 0
            and queued_tokens + new_tokens > token_limit
        ):
            self._refuse(
                f"The server is overloaded: {queued_tokens} prompt tokens are waiting "
                f"to be processed (limit {token_limit}); retry later"
            )

    def _refuse(self, message: str) -> None:
        self._state.num_refused_total += 1
        raise AdmissionRefused(429, message, self.limits.retry_after_s)

    def _report_first_token(self, request_id: str) -> None:
        self._report(Started((request_id,)))

    def _report_engine_done(self, request_id: str) -> None:
        self._report(EngineDone((request_id,)))

    def _report(self, message: ToAdmission) -> None:
        try:
            self.tell(message)
        except ActorStopped:  # the engine is stopping: nothing is admitted any more
            pass

    def _mark_engine_done(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            entry = self._state.entries.get(request_id)
            if entry is not None and entry.in_engine:
                entry.in_engine = False
                self._state.num_in_engine -= 1
        self._mark_started(request_ids)  # one that ended without a token waits no more

    def _mark_started(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            entry = self._state.entries.get(request_id)
            if entry is not None and not entry.started:
                entry.started = True
                self._state.num_unstarted_prompt_tokens -= entry.num_prompt_tokens

    def _finish(self, request_ids: Sequence[str], abort: bool) -> None:
        to_abort = []
        for request_id in request_ids:
            entry = self._state.entries.pop(request_id, None)
            if entry is None:
                continue
            if not entry.started:
                self._state.num_unstarted_prompt_tokens -= entry.num_prompt_tokens
            if entry.in_engine:
                self._state.num_in_engine -= 1
            if abort and not entry.stream.finished:
                to_abort.append(request_id)
        if to_abort:
            self._engine.abort(to_abort)

    def _fail_all(self, message: str, retryable: bool = False) -> None:
        if retryable:
            self._state.unresponsive_message = message
        else:
            self._state.failed_message = message
        for entry in self._state.entries.values():
            entry.stream.push(finish_reason="error", error=message, retryable=retryable)

    def _stats(self) -> AdmissionStats:
        state = self._state
        num_unfinished = len(state.entries)
        return AdmissionStats(
            num_unfinished=num_unfinished,
            num_unsent=num_unfinished - state.num_in_engine,
            num_queued=max(0, state.num_in_engine - self.limits.max_num_running),
            num_queued_prompt_tokens=state.num_unstarted_prompt_tokens,
            num_admitted_total=state.num_admitted_total,
            num_refused_total=state.num_refused_total,
            draining=state.draining,
        )


def check_request_limits(params: SamplingParams, limits: AdmissionLimits) -> None:
    """Per-request limits that keep one request from taking an unfair share of the server."""
    if params.n > limits.max_n:
        raise RequestLimitError("n", f"n must be at most {limits.max_n}, got {params.n}")
    if len(params.stop) > limits.max_stop_strings:
        raise RequestLimitError(
            "stop",
            f"at most {limits.max_stop_strings} stop strings are allowed, got {len(params.stop)}",
        )
    longest = max((len(s) for s in params.stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise RequestLimitError(
            "stop",
            f"stop strings must be at most "
            f"{limits.max_stop_string_chars} characters, got {longest}",
        )
    if len(params.logit_bias) > limits.max_logit_bias_entries:
        raise RequestLimitError(
            "logit_bias",
            f"logit_bias may hold at most "
            f"{limits.max_logit_bias_entries} entries, got "
            f"{len(params.logit_bias)}",
        )


def child_sampling_params(params: SamplingParams, sample: int) -> SamplingParams:
    """The engine runs each of a request's n samples as its own request. Parallel samples
    need different noise; a user seed stays reproducible (sample i uses seed + i)."""
    if params.n == 1:
        return params
    seed = params.seed
    if seed is not None:
        seed = seed + sample if seed + sample <= _SEED_MAX else seed - sample
    return params.replace(n=1, seed=seed)
