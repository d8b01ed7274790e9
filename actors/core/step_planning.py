"""Planning a step: which requests the scheduler offers the KV cache, and how many tokens each.

Running requests go first (decodes and continuing prefill chunks, in admission order),
each catching its computed tokens up with its known-or-placeholder tokens within the
step's token budget; waiting requests, best first, then ask for what is left. When a
running request cannot get its blocks, `pick_victim` names the one that gives way.

These are choices only: they read the scheduler's request sets and change none of them
(actors/core/scheduler.py allocates, preempts and commits).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from actors.core.kv_allocation import WaitingAlloc
from actors.core.request import Request
from actors.core.scheduler_config import SchedulerConfig
from actors.core.spec_scheduling import wanted_draft_slots
from actors.core.step_batch import StepBatch, WaitingQueue


def plan_running(
    config: SchedulerConfig,
    running: Collection[Request],
    blocking_speculation: Iterable[Request],
    waiting: WaitingQueue,
    step_id: int,
) -> tuple[StepBatch, int]:
    """The running rows of step `step_id` (in admission order) and the token budget they
    leave. `blocking_speculation`: the unfinished requests that may keep the step from
    speculating (spec_scheduling.blocks_speculation)."""
    token_budget = config.max_num_batched_tokens
    num_speculative_tokens = config.num_speculative_tokens
    wanted_slots = (
        wanted_draft_slots(
            running,
            blocking_speculation,
            num_speculative_tokens,
            step_id,
            token_budget,
            config.block_size,
            prefill_expected=bool(waiting) and len(running) < config.max_num_seqs,
        )
        if num_speculative_tokens
        else None
    )
    batch = StepBatch()
    max_rows = _max_running_rows(config, len(running))
    for index, request in enumerate(running):
        if token_budget == 0 or len(batch.requests) == max_rows:
            break
        if config.step_groups > 1 and request.num_output_placeholders:
            continue  # its previous step's token is still in the pipeline
        num_pending = request.num_tokens_with_placeholders
        if num_pending >= request.max_total_tokens:
            continue  # every allowed output is sampled or in flight: about to finish
        num_slots = (
            0 if wanted_slots is None else max(0, min(wanted_slots[index], token_budget - 1))
        )
        num_new = min(num_pending - request.num_computed_tokens + num_slots, token_budget)
        if num_new <= 0:
            continue
        batch.add(request, num_new, num_slots, num_pending)
        token_budget -= num_new
    return batch, token_budget


def _max_running_rows(config: SchedulerConfig, num_running: int) -> int | None:
    """Running requests one step may hold: a 1/step_groups share of them under the
    pipeline's batch queue, so that each step in flight carries its part; else all."""
    groups = config.step_groups
    return None if groups == 1 else -(-num_running // groups)


def plan_waiting(
    config: SchedulerConfig, waiting: WaitingQueue, num_running: int, token_budget: int
) -> tuple[list[WaitingAlloc], dict[str, Request]]:
    """The waiting requests, best first, that may join the step (each needs at least one
    token of `token_budget` and a free row): their allocation asks, and them by id."""
    max_entries = min(config.max_num_seqs - num_running, token_budget)
    entries: list[WaitingAlloc] = []
    requests: dict[str, Request] = {}
    if max_entries <= 0:
        return entries, requests
    for request in waiting.best_first():
        if request.num_output_placeholders > 0:
            continue  # preempted with tokens in flight: resume once they have arrived
        token_ids = request.all_token_ids if request.output_token_ids else request.prompt_token_ids
        entries.append(
            WaitingAlloc(
                request.request_id,
                token_ids,
                request.num_prompt_tokens,
                config.max_num_batched_tokens,
                request.cache_salt,
                reuse_cached_prefix=request.sampling_params.prompt_logprobs is None,
            )
        )
        requests[request.request_id] = request
        if len(entries) == max_entries:
            break
    return entries, requests


def pick_victim(running: Iterable[Request]) -> Request:
    """The running request to preempt: lowest priority (highest value) first; among equals
    the most recently admitted."""
    return max(enumerate(running), key=lambda item: (item[1].priority, item[0]))[1]
