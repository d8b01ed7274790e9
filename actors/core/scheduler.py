"""Continuous-batching scheduler: which requests run each step, and how many tokens each.

One rule covers prefill and decode: each step, a request's computed tokens catch up with
its known-or-placeholder tokens, within the step's token budget. Running requests go first
(decodes and continuing prefill chunks, in admission order); waiting requests then fill
what is left of the budget, a long prompt running in chunks over several steps. Those
choices are actors/core/step_planning.py's; this class allocates, preempts and commits.

Scheduling is optimistic: `num_computed_tokens` advances when a step is scheduled, and a
step whose chunk reaches the end of a request's tokens adds an output placeholder that the
step's result resolves. So step N+1 can be built before step N's tokens are known.

When a running request cannot get KV blocks, the lowest-priority, most recently admitted
running request is preempted: its blocks and runner row are freed, and it waits at the
front of the queue to be recomputed from prompt + outputs.

It owns the KV cache manager (called once per step); both live on the engine loop
(actors/core/engine_loop.py), the only caller.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from actors.core.grammar import GrammarError, GrammarMatcher
from actors.core.grammar_state import GrammarState
from actors.core.kv_allocation import AllocateStep, KVUsage, WaitingAlloc, WaitingGrant
from actors.core.kv_cache_manager import KVCacheManager
from actors.core.request import Request, RequestStatus
from actors.core.scheduler_config import SchedulerConfig
from actors.core.spec_scheduling import blocks_speculation, emitted_counts
from actors.core.step_batch import (
    StepBatch,
    StepResult,
    WaitingQueue,
    append_one_each,
    append_runs,
    check_tokens_are_expected,
    grammar_rows,
    offer_completed_blocks,
    start_rows,
)
from actors.core.step_planning import pick_victim, plan_running, plan_waiting
from actors.protocol.messages import (
    CachedRequestData,
    EngineRequest,
    NewRequestData,
    RequestFinish,
    SchedulerOutput,
    StepOutput,
)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, grammars: GrammarState | None = None
    ) -> None:
        """`kv`: the KV cache this scheduler alone allocates from; `grammars`: structured
        outputs (None refuses requests that ask for one)."""
        self.config = config
        self.kv = kv
        self.grammars = grammars
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._blocking_speculation: dict[str, Request] = {}
        """Unfinished requests with a grammar or prompt logprobs (spec_scheduling)."""
        self._running: dict[str, Request] = {}  # holding a runner row, in admission order
        self._waiting = WaitingQueue()
        self._blocks_to_free: list[str] = []  # ids whose KV blocks the manager may still hold
        self._rows_to_free: set[str] = set()  # ids whose runner rows the next step frees
        # step id, the requests that sample in it, their draft slots
        self._in_flight: deque[tuple[int, dict[str, Request], dict[str, int]]] = deque()
        self._next_step_id = 0
        self.num_preemptions_total = 0
        self.kv_usage: KVUsage | None = None
        """The KV cache's usage after the latest step's allocation."""

    # ---- counts ---------------------------------------------------------------------

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    def unfinished_requests(self) -> list[Request]:
        return list(self._requests.values())

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # ---- requests in and out --------------------------------------------------------

    def add_request(self, engine_request: EngineRequest) -> Future[GrammarMatcher] | None:
        """Queue a request. One with a structured output whose grammar is new waits until
        its compile, returned here, is done and given to `grammar_compiled`. Raises
        ValueError for a request the engine cannot take."""
        if engine_request.request_id in self._requests:
            raise ValueError(f"request id {engine_request.request_id!r} is already in the engine")
        embeds = engine_request.prompt_embeds
        if embeds is not None and embeds.hidden_size != self.config.prompt_embeds_hidden_size:
            raise ValueError(
                "this engine does not take prompt embeddings (--enable-prompt-embeds)"
                if self.config.prompt_embeds_hidden_size is None
                else f"prompt embeddings of width {embeds.hidden_size}; the model's hidden "
                f"size is {self.config.prompt_embeds_hidden_size}"
            )
        request = Request.from_engine_request(
            engine_request, self.config.max_model_len, queued_time=time.monotonic()
        )
        compiling = None
        if request.sampling_params.structured_output is not None:
            if self.grammars is None:
                raise ValueError("this engine does not apply structured outputs")
            compiling = self.grammars.compile(request.sampling_params)
            if compiling.done() and compiling.exception() is None:
                request.grammar, compiling = compiling.result(), None
            else:  # a compile error, too, reaches the request through grammar_compiled
                request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._requests[request.request_id] = request
        if blocks_speculation(request):
            self._blocking_speculation[request.request_id] = request
        if compiling is None:
            self._waiting.push(request)
        return compiling

    def grammar_compiled(
        self, request_id: str, compiled: Future[GrammarMatcher]
    ) -> RequestFinish | None:
        """Queue a request whose grammar has compiled; the request's error finish when it
        did not compile. Nothing for a request that ended meanwhile."""
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_GRAMMAR:
            return None
        try:
            request.grammar = compiled.result()
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
            self._finish(request, RequestStatus.FINISHED_ERROR)
            error = (
                str(exc)
                if isinstance(exc, GrammarError)
                else f"compiling its grammar failed ({type(exc).__name__})"
            )
            return RequestFinish(request_id, "error", error=error)
        request.status = RequestStatus.WAITING
        self._waiting.push(request)
        return None

    def abort_requests(self, request_ids: Sequence[str]) -> list[str]:
        """Abort the unfinished ones among `request_ids`; returns those aborted."""
        aborted: list[str] = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request_id)
        return aborted

    # ---- one step -------------------------------------------------------------------

    def free_finished_blocks(self) -> None:
        """Release the KV blocks of requests that finished since the last step now (the
        next step would otherwise do it)."""
        if self._blocks_to_free:
            self.kv.free(self._take_blocks_to_free())

    def schedule(self) -> SchedulerOutput | None:
        """Build the next step; None when there is nothing to run or no room in flight."""
        if len(self._in_flight) >= self.config.max_steps_in_flight:
            return None
        started = time.perf_counter()
        running, token_budget = plan_running(
            self.config,
            self._running.values(),
            self._blocking_speculation.values(),
            self._waiting,
            self._next_step_id,
        )
        waiting_entries, waiting_requests = plan_waiting(
            self.config, self._waiting, len(self._running), token_budget
        )
        if not running and not waiting_entries:
            self.free_finished_blocks()
            return None
        batch, grants = self._allocate(running, waiting_entries, token_budget)
        if not batch and not grants:
            return None
        return self._commit(batch, grants, waiting_requests, started)

    def update_from_step(self, out: StepOutput) -> StepResult:
        """Apply a step's sampled tokens and decide which requests they finish.

        The token-level stops are decided here (step_batch.token_finish) and nowhere else,
        in vLLM's order: EOS (unless ignore_eos) and stop_token_ids count from the
        min_tokens-th output token on, then max_tokens / the context length. A finished
        request's blocks are freed with the next allocation and its row with the next step.
        Stop strings are the front end's, which aborts the request when it finds one.

        Steps must be reported in the order they were scheduled. A request that sampled in
        the step but got no token is finished with 'error'.
        """
        sampling, draft_slots = self._pop_in_flight(out)
        self.kv.loads_done(out.kv_loads_done_through)
        result = StepResult()
        if out.error is not None:
            self._fail(out.failed_request_ids, out.error, result)
        counts = emitted_counts(out, draft_slots)
        if counts is None:
            self._fail(
                tuple(sampling),
                f"step {out.step_id} returned "
                f"{len(out.sampled_token_ids)} tokens for {len(out.request_ids)} "
                "requests (more than their draft slots allow, or counts that do not "
                "add up)",
                result,
            )
            return self._with_ready_masks(result)
        requests = [sampling.pop(request_id) for request_id in out.request_ids]
        token_ids = out.sampled_token_ids.tolist()
        if draft_slots or out.num_sampled_tokens is not None or out.num_draft_tokens is not None:
            # a speculative step: a run of tokens per request
            finished = append_runs(
                out, requests, token_ids, counts, draft_slots, self._next_step_id, result
            )
        else:
            finished = append_one_each(requests, token_ids, result)
        if self.kv.enable_prefix_caching:  # before the finishes: last blocks count too
            offer_completed_blocks(self.kv, result)
        for request, finish in finished:
            self._finish(request, RequestStatus.from_finish_reason(finish.reason))
        result.finished.extend(finished)
        self._fail(
            tuple(r.request_id for r in sampling.values() if not r.is_finished),
            f"step {out.step_id} returned no token",
            result,
        )
        return self._with_ready_masks(result)

    def _pop_in_flight(self, out: StepOutput) -> tuple[dict[str, Request], dict[str, int]]:
        """The sampling requests and draft slots of the oldest step in flight, which `out`
        must report."""
        if not self._in_flight or self._in_flight[0][0] != out.step_id:
            expected = self._in_flight[0][0] if self._in_flight else None
            raise ValueError(f"step output {out.step_id} out of order; expected {expected}")
        _, sampling, draft_slots = self._in_flight[0]
        check_tokens_are_expected(out, sampling)
        self._in_flight.popleft()
        return sampling, draft_slots

    def _with_ready_masks(self, result: StepResult) -> StepResult:
        """Every step result releases the deferred masks it made exact: a step waiting for
        its mask must get it whatever happened to the step before."""
        if self.grammars is not None:
            result.grammar_masks = self.grammars.ready_masks()
        return result

    def _fail(self, request_ids: Sequence[str], error: str, result: StepResult) -> None:
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ERROR)
                result.finished.append((request, RequestFinish(request_id, "error", error=error)))

    # ---- allocating -----------------------------------------------------------------

    def _allocate(
        self, running: StepBatch, waiting: list[WaitingAlloc], token_budget: int
    ) -> tuple[StepBatch, tuple[WaitingGrant, ...]]:
        """Ask for blocks, preempting until every remaining running row gets its blocks;
        returns those rows (with their new blocks) and the admitted waiting requests' grants.

        Waiting requests are admitted only when nothing had to be preempted.
        """
        granted = StepBatch()
        pending = running
        waiting_entries = tuple(waiting)
        while True:
            allocation = self.kv.allocate_step(
                AllocateStep(
                    self._take_blocks_to_free(),
                    pending.running_allocs(),
                    waiting_entries,
                    token_budget,
                )
            )
            self.kv_usage = allocation.usage or self.kv_usage
            num_ok = allocation.num_running_ok
            pending.set_new_block_ids(allocation.new_block_ids)
            if num_ok == len(pending):
                return granted.joined(pending), allocation.waiting
            victim = pick_victim(self._running.values())
            self._preempt(victim)
            granted = granted.joined(pending.rows(0, num_ok)).without(victim)
            pending = pending.rows(num_ok, len(pending)).without(victim)
            waiting_entries = ()
            if not pending:
                return granted, ()

    # ---- committing -----------------------------------------------------------------

    def _commit(
        self,
        batch: StepBatch,
        grants: Sequence[WaitingGrant],
        waiting_requests: dict[str, Request],
        started: float,
    ) -> SchedulerOutput:
        num_running = len(batch)
        new_requests = [
            self._admit(waiting_requests[grant.request_id], grant, batch) for grant in grants
        ]
        sampling, draft_slots = start_rows(batch)
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight.append((step_id, sampling, draft_slots))
        grammar_bitmask, mask_deferred = None, False
        if self.grammars is not None:
            grammar_bitmask, mask_deferred = self.grammars.plan_step(step_id, grammar_rows(batch))
        finished_rows, self._rows_to_free = frozenset(self._rows_to_free), set()
        request_ids = tuple(batch.request_ids())
        return SchedulerOutput(
            step_id=step_id,
            new_requests=tuple(new_requests),
            cached_requests=CachedRequestData(
                request_ids=request_ids[:num_running],
                new_block_ids=tuple(batch.new_block_ids[:num_running]),
            ),
            scheduled_request_ids=request_ids,
            num_scheduled_tokens=tuple(batch.num_scheduled_tokens),
            num_computed_tokens=tuple(batch.num_computed_tokens),
            samples_token=tuple(batch.samples_token),
            finished_request_ids=finished_rows,
            schedule_time_s=time.perf_counter() - started,
            grammar_bitmask=grammar_bitmask,
            grammar_mask_deferred=mask_deferred,
            num_draft_slots=tuple(batch.num_draft_slots) if draft_slots else (),
            kv_transfer=self.kv.take_transfer(),
        )

    def _admit(self, request: Request, grant: WaitingGrant, batch: StepBatch) -> NewRequestData:
        self._waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self._running[request.request_id] = request
        request.block_ids = list(grant.block_ids)
        request.num_computed_tokens = grant.num_cached_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = grant.num_cached_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        new_request = NewRequestData(
            request_id=request.request_id,
            token_ids=request.all_token_ids,
            prompt_len=request.num_prompt_tokens,
            block_ids=grant.block_ids,
            num_computed_tokens=grant.num_cached_tokens,
            sampling_params=request.sampling_params,
            eos_token_ids=request.eos_token_ids,
            prompt_embeds=request.prompt_embeds,
        )
        batch.add(request, grant.num_new_tokens)
        return new_request

    def _preempt(self, request: Request) -> None:
        del self._running[request.request_id]
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.block_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._blocks_to_free.append(request.request_id)
        self._rows_to_free.add(request.request_id)
        self._waiting.push(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            del self._running[request.request_id]
            self._rows_to_free.add(request.request_id)
        elif request.status is not RequestStatus.WAITING_FOR_GRAMMAR:
            self._waiting.remove(request)
        # Waiting requests hold no blocks, but the KV manager may keep their prompt hashes.
        self._blocks_to_free.append(request.request_id)
        request.status = status
        del self._requests[request.request_id]
        self._blocking_speculation.pop(request.request_id, None)

    def _take_blocks_to_free(self) -> tuple[str, ...]:
        request_ids, self._blocks_to_free = tuple(self._blocks_to_free), []
        return request_ids
