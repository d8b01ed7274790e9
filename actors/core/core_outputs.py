"""The engine core's outgoing side: one EngineCoreOutputs per step for each front end that
owns a request in it (front end 0 always, since it records the step's timings), built
from the step's arrays without per-token copies when one front end owns everything. Each
carries the core's load after the step, which front ends balancing several cores read."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from actors.core.step_batch import StepResult
from actors.protocol.messages import (
    AdmittedRequest,
    CoreLoad,
    EngineCoreOutputs,
    LogprobsArrays,
    PredecessorAborted,
    PromptLogprobs,
    RequestFinish,
    SchedulerStats,
    StepOutput,
    ToFrontEnd,
)

Send = Callable[[int, ToFrontEnd], None]
STATS_CLIENT = 0
"""The front end that records every step's timings."""


class CoreOutputs:
    def __init__(self, send: Send) -> None:
        self._send = send

    def step(
        self,
        out: StepOutput,
        result: StepResult,
        admitted: Sequence[tuple[int, AdmittedRequest]] = (),
        scheduler_stats: SchedulerStats | None = None,
        prompt_clients: Sequence[int | None] = (),
        load: Callable[[int], CoreLoad] | None = None,
    ) -> None:
        """Send one step's tokens, finishes, first admissions and prompt logprobs to their
        front ends (`prompt_clients`: the front end of each request in
        out.prompt_logprobs, None for one that is gone), with the core's `load(client)`."""
        rows_by_client: dict[int, list[int]] = {}
        for index, request in enumerate(result.requests):
            rows_by_client.setdefault(request.client_index, []).append(index)
        finished = _group(((r.client_index, f) for r, f in result.finished))
        admissions = _group(admitted)
        prompts = _group((c, i) for i, c in enumerate(prompt_clients) if c is not None)
        clients = {STATS_CLIENT, *rows_by_client, *finished, *admissions, *prompts}
        for client in sorted(clients):
            indices = rows_by_client.get(client, [])
            tokens, counts, logprobs = _columns(out, result, indices)
            self._send(
                client,
                EngineCoreOutputs(
                    step_id=out.step_id,
                    request_ids=tuple(result.requests[i].request_id for i in indices),
                    new_token_ids=tokens,
                    num_new_tokens=counts,
                    logprobs=logprobs,
                    prompt_logprobs=_prompt_rows(out.prompt_logprobs, prompts.get(client)),
                    num_draft_tokens=(
                        np.asarray([result.num_drafts[i] for i in indices], np.int32)
                        if result.num_drafts
                        else None
                    ),
                    finished=tuple(finished.get(client, ())),
                    admitted=tuple(admissions.get(client, ())),
                    step_stats=out.stats if client == STATS_CLIENT else None,
                    scheduler_stats=scheduler_stats if client == STATS_CLIENT else None,
                    load=None if load is None else load(client),
                ),
            )

    def finish(self, finishes: Sequence[tuple[int, RequestFinish]]) -> None:
        """Requests that ended outside a step (refused on arrival, aborted at shutdown)."""
        for client, client_finishes in _group(finishes).items():
            self._send(client, EngineCoreOutputs(step_id=-1, finished=tuple(client_finishes)))

    def predecessor_aborted(self, client: int, num_requests: int) -> None:
        """The requests a front end's previous process left behind were aborted: their
        finishes mean nothing to the new process (it never had them), their number does."""
        self._send(client, PredecessorAborted(num_requests))


def _columns(
    out: StepOutput, result: StepResult, indices: list[int]
) -> tuple[np.ndarray, np.ndarray | None, LogprobsArrays | None]:
    """The new tokens (request-major), their counts (None: one each) and logprobs of the
    requests at `indices` of the result."""
    one_each = out.num_sampled_tokens is None
    if one_each and len(indices) == len(out.request_ids):  # all rows to one front end: no copies
        tokens = out.sampled_token_ids.astype(np.int32, copy=False)
        return tokens, None, out.logprobs
    if one_each:
        rows = np.asarray([result.rows[i] for i in indices], dtype=np.int64)
        counts = None
    else:
        counts = np.asarray([result.num_tokens[i] for i in indices], dtype=np.int32)
        rows = (
            np.concatenate(
                [np.arange(result.rows[i], result.rows[i] + result.num_tokens[i]) for i in indices]
            )
            if indices
            else np.zeros(0, np.int64)
        )
    tokens = out.sampled_token_ids[rows].astype(np.int32, copy=False)
    logprobs = out.logprobs.take(rows) if out.logprobs is not None else None
    return tokens, counts, logprobs


def _prompt_rows(prompt: PromptLogprobs | None, indices: list[int] | None) -> PromptLogprobs | None:
    if prompt is None or not indices:
        return None
    return prompt if len(indices) == len(prompt.request_ids) else prompt.take(indices)


def _group(pairs: object) -> dict[int, list]:
    grouped: dict[int, list] = {}
    for client, item in pairs:  # type: ignore[attr-defined]
        grouped.setdefault(client, []).append(item)
    return grouped
