"""A front end's handle on the engine core: requests in, pull-based streams out.

    add_request -> sampler actor (registers the stream) -> endpoint -> engine core
    endpoint <- EngineCoreOutputs (one per step) -> sampler actor -> each RequestStream
    a stop string found by the sampler actor -> AbortRequests -> engine core

No torch here: the core may be another process (ZMQ endpoint) or share this event loop
(in-process endpoint); the client cannot tell and does not care.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog

from actors.frontend.output_stream import RequestStream
from actors.frontend.sampler import OutputProcessor, SamplerActor
from actors.protocol.messages import (
    AbortRequests,
    ClientHello,
    CoreLoad,
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    EngineRequest,
    EngineStartupFailed,
    FailRequests,
    GrammarVocab,
    Heartbeat,
    PredecessorAborted,
    RegisterRequest,
    SchedulerStats,
    StepStats,
    UtilityCall,
    UtilityResult,
)
from actors.protocol.transport import ClientEndpoint, TransportClosed

if TYPE_CHECKING:
    from actors.frontend.detokenizer import TokenDecoder
    from telemetry.records import RequestRecord

log = structlog.get_logger("tandem.engine_client")


class EngineUnavailable(RuntimeError):
    """The engine core cannot answer (stopped, dead, or the call timed out)."""


class EngineClient:
    """`on_ready`, `on_dead` and `on_startup_failed` are called on the event loop when the
    core says so. `on_request_finished` receives every finished request's record and
    `step_observers` every step's stats (sent to front end 0 only). `on_predecessor_aborted`
    receives how many requests a previous process of this front end left in the core (which
    aborted them when this one connected). `on_load` receives the core's load with each
    step's outputs and heartbeat (a balancer over several cores reads it)."""

    def __init__(
        self,
        endpoint: ClientEndpoint,
        tokenizer: TokenDecoder | None,
        *,
        client_index: int = 0,
        on_request_finished: Callable[[RequestRecord], None] | None = None,
        step_observers: Sequence[Callable[[StepStats], None]] = (),
        on_scheduler_stats: Callable[[SchedulerStats], None] | None = None,
        on_ready: Callable[[EngineReady], None] | None = None,
        on_dead: Callable[[str], None] | None = None,
        on_startup_failed: Callable[[EngineStartupFailed], None] | None = None,
        on_predecessor_aborted: Callable[[int], None] | None = None,
        on_load: Callable[[CoreLoad], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.client_index = client_index
        self.has_tokenizer = tokenizer is not None
        self._tokenizer = tokenizer
        self._sent_grammar_vocab = False
        self.sampler_actor = SamplerActor(
            OutputProcessor(tokenizer, on_request_finished=on_request_finished),
            on_stopped=self._abort_in_core,
            step_observers=step_observers,
            on_scheduler_stats=on_scheduler_stats,
        )
        self.ready: EngineReady | None = None
        self._on_ready, self._on_dead, self._on_startup_failed = (
            on_ready,
            on_dead,
            on_startup_failed,
        )
        self._on_predecessor_aborted = on_predecessor_aborted
        self._on_load = on_load
        self._call_ids = itertools.count()
        self._calls: dict[int, tuple[anyio.Event, list[UtilityResult]]] = {}
        self.is_running = False
        self.last_heard_at = time.monotonic()
        """When the core last sent anything (a process core sends a Heartbeat at least every
        HEARTBEAT_INTERVAL_S): app/engine_watchdog.py judges a stall by it."""
        self.heard = anyio.Event()
        """Set once the core has sent anything: the connection stands."""

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Receive from the core until the endpoint closes or `close()`."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sampler_actor.run)
            self.endpoint.send(ClientHello(self.client_index))
            self.is_running = True
            task_status.started()
            try:
                await self._receive_loop()
            finally:
                self.is_running = False
                self.sampler_actor.close()

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> RequestStream:
        stream = RequestStream(request.request_id, num_prompt_tokens=len(request.prompt_token_ids))
        if not self.has_tokenizer and request.sampling_params.stop:
            stream.push(
                finish_reason="error",
                error="stop strings need a tokenizer; this model serves token ids only",
            )
            return stream
        if request.client_index != self.client_index:
            request = _with_client(request, self.client_index)
        if request.sampling_params.structured_output is not None:
            self._send_grammar_vocab()
        self.sampler_actor.tell(RegisterRequest(request, stream))
        self.endpoint.send(request)
        return stream

    def _send_grammar_vocab(self) -> None:
        """The core compiles grammars against this front end's tokenizer: send it once,
        ahead of the first request that needs it (without one, the core refuses those)."""
        if self._sent_grammar_vocab or self._tokenizer is None:
            return
        self._sent_grammar_vocab = True
        raw: Any = getattr(self._tokenizer, "raw", self._tokenizer)  # a bare Tokenizer too
        self.endpoint.send(
            GrammarVocab(raw.to_str(), tuple(getattr(self._tokenizer, "eos_token_ids", ())))
        )

    def abort(self, request_ids: list[str]) -> None:
        """The reader gave up: end the streams here and free the rows in the core."""
        if request_ids:
            self.sampler_actor.tell(AbortRequests(tuple(request_ids)))
            self._abort_in_core(request_ids)

    def fail_all(self, message: str) -> None:
        """The core is gone: every open stream ends with an error."""
        self.sampler_actor.tell(FailRequests(message))

    async def call(self, method: str, timeout_s: float = 10.0) -> UtilityResult:
        """Ask the core something outside the step loop ('stats', 'check_kv_invariants')."""
        if not self.is_running:
            raise EngineUnavailable("the engine core is not connected")
        call_id = next(self._call_ids)
        done, box = anyio.Event(), list[UtilityResult]()
        self._calls[call_id] = (done, box)
        try:
            self.endpoint.send(UtilityCall(call_id, method, self.client_index))
            with anyio.move_on_after(timeout_s):
                await done.wait()
        except TransportClosed as exc:
            raise EngineUnavailable(str(exc)) from None
        finally:
            self._calls.pop(call_id, None)
        if not box:
            raise EngineUnavailable(f"the engine core did not answer {method!r} in {timeout_s} s")
        return box[0]

    def close(self) -> None:
        self.endpoint.close()

    # ---- incoming ---------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                message = await self.endpoint.receive()
            except TransportClosed:
                return
            self.last_heard_at = time.monotonic()
            self.heard.set()
            if isinstance(message, EngineCoreOutputs):
                if message.load is not None and self._on_load is not None:
                    self._on_load(message.load)
                self.sampler_actor.tell(message)
            elif isinstance(message, Heartbeat):
                if message.load is not None and self._on_load is not None:
                    self._on_load(message.load)
            elif isinstance(message, UtilityResult):
                self._resolve(message)
            elif isinstance(message, EngineReady):
                self.ready = message
                if self._on_ready is not None:
                    self._on_ready(message)
            elif isinstance(message, EngineDead):
                log.error("engine_dead", reason=message.reason)
                if self._on_dead is not None:
                    self._on_dead(message.reason)
            elif isinstance(message, EngineStartupFailed):
                if self._on_startup_failed is not None:
                    self._on_startup_failed(message)
            elif isinstance(message, PredecessorAborted):
                log.warning("predecessor_requests_aborted", num_requests=message.num_requests)
                if self._on_predecessor_aborted is not None:
                    self._on_predecessor_aborted(message.num_requests)

    def _resolve(self, result: UtilityResult) -> None:
        pending = self._calls.get(result.call_id)
        if pending is not None:
            pending[1].append(result)
            pending[0].set()

    def _abort_in_core(self, request_ids: list[str]) -> None:
        try:
            self.endpoint.send(AbortRequests(tuple(request_ids)))
        except TransportClosed:  # the core is gone: nothing to free
            pass


def _with_client(request: EngineRequest, client_index: int) -> EngineRequest:
    result: EngineRequest = msgspec.structs.replace(request, client_index=client_index)
    return result
