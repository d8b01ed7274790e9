"""Speculative steps of the V1 runner, with the CPU proposer (gpu/spec_decode/ngram_proposer.py).

V1 synchronises every step, so it knows each row's drafts before it builds the batch: a
speculating row runs its last token plus its d = min(drafts, slots) drafts, not every
slot the scheduler planned (the scheduler corrects from the emitted count either way).
Verification is V2's: the ordinary sampler over every logit row, then the matching
draft prefix is accepted (kernels/rejection_sample.py), so both runners emit the same
tokens. Rows of a runner with custom logits processors do not draft: the processors see
one logit row per request.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from actors.protocol.messages import LogprobsArrays, SchedulerOutput, StepOutput, StepStats
from gpu.sampling.sampler import Sampler, SamplerOutput
from gpu.sampling.state import SamplingState
from gpu.spec_decode.ngram_proposer import NgramProposer
from gpu.spec_decode.spec_output import spec_stats
from gpu.worker import ModelWorker
from kernels.rejection_sample import accept_draft_prefix


class SpecStepRunner(Protocol):
    """What a speculative step uses of the V1 runner (gpu/runner_v1/runner.py)."""

    worker: ModelWorker
    device: torch.device
    requests: dict[str, Any]
    """Request id -> the runner's state of it (row, token_ids, num_computed_tokens, ...)."""
    sampler: Sampler
    sampling_state: SamplingState
    proposer: NgramProposer | None
    logits_processors: object | None
    forward: Callable[..., torch.Tensor]

    def build_inputs(self, reqs: list[Any], num_scheduled: np.ndarray) -> Any: ...

    def run_model(self, inputs: Any) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True, slots=True)
class _Drafts:
    token_ids: np.ndarray  # [num_reqs, K] int32, -1 past each row's used drafts
    num_used: np.ndarray  # [num_reqs] int64, drafts each row runs


def _drafts(runner: SpecStepRunner, sched: SchedulerOutput, rows_np: np.ndarray) -> _Drafts:
    proposer = runner.proposer
    assert proposer is not None
    slots = np.asarray(sched.num_draft_slots, dtype=np.int64)
    num_reqs = slots.size
    k = proposer.config.num_speculative_tokens
    token_ids = np.full((num_reqs, k), -1, dtype=np.int32)
    num_used = np.zeros(num_reqs, dtype=np.int64)
    speculating = np.flatnonzero(slots > 0)
    if speculating.size and runner.logits_processors is None:
        drafts, num_drafts = proposer.propose(rows_np[speculating])
        num_used[speculating] = np.minimum(num_drafts, slots[speculating])
        columns = np.arange(k)[None, :]
        token_ids[speculating] = np.where(columns < num_used[speculating, None], drafts, -1)
    return _Drafts(token_ids, num_used)


def execute_spec_step(runner: SpecStepRunner, sched: SchedulerOutput, started: float) -> StepOutput:
    """One V1 step in which some rows have draft slots (see the module doc)."""
    reqs = [runner.requests[r] for r in sched.scheduled_request_ids]
    rows_np = np.asarray([r.row for r in reqs], dtype=np.int32)
    drafts = _drafts(runner, sched, rows_np)
    slots = np.asarray(sched.num_draft_slots, dtype=np.int64)
    num_run = np.asarray(sched.num_scheduled_tokens, dtype=np.int64) - slots + drafts.num_used
    # The drafts join each row's known tokens for the forward only.
    with_drafts = [
        dataclasses.replace(r, token_ids=r.token_ids + drafts.token_ids[i, :n].tolist()) if n else r
        for i, (r, n) in enumerate(zip(reqs, drafts.num_used))
    ]
    inputs = runner.build_inputs(with_drafts, num_run)
    hidden = runner.run_model(inputs)
    counts = drafts.num_used + 1
    cu = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    logit_req = np.repeat(np.arange(len(reqs)), counts)
    offsets = np.arange(int(cu[-1])) - cu[logit_req]
    ends = inputs.attn_metadata.query_start_loc_cpu[1:].astype(np.int64)
    logits_indices = ends[logit_req] - counts[logit_req] + offsets
    dev = runner.device
    logits = runner.worker.model.compute_logits(hidden[torch.from_numpy(logits_indices).to(dev)])
    logit_req_gpu = torch.from_numpy(logit_req).to(dev)
    num_outputs = inputs.num_output_tokens[logit_req_gpu] + torch.from_numpy(offsets).to(dev)
    max_num_logprobs = max(r.num_logprobs for r in reqs)
    sampled = runner.sampler(
        logits,
        inputs.rows_gpu[logit_req_gpu],
        rows_np[logit_req],
        inputs.positions[torch.from_numpy(logits_indices).to(dev)] + 1,
        num_outputs.to(torch.int32),
        None if max_num_logprobs < 0 else max_num_logprobs,
    )
    output, num_accepted = accept_draft_prefix(
        torch.from_numpy(cu.astype(np.int32)).to(dev),
        torch.from_numpy(drafts.token_ids).to(dev),
        sampled.sampled_token_ids,
    )
    return _finish(
        runner,
        sched,
        reqs,
        num_run,
        output.cpu().numpy(),
        num_accepted.cpu().numpy().astype(np.int64),
        drafts,
        sampled,
        cu,
        started,
    )


def _finish(
    runner: SpecStepRunner,
    sched: SchedulerOutput,
    reqs: list[Any],
    num_run: np.ndarray,
    output: np.ndarray,
    num_accepted: np.ndarray,
    drafts: _Drafts,
    sampled: SamplerOutput,
    cu: np.ndarray,
    started: float,
) -> StepOutput:
    """Advance each row by its emitted tokens and pack the step's output."""
    is_real = np.zeros(len(reqs), dtype=bool)
    proposer = runner.proposer
    assert proposer is not None
    for i, req in enumerate(reqs):
        num_accepted_i = int(num_accepted[i])
        req.num_computed_tokens += int(num_run[i]) - int(drafts.num_used[i]) + num_accepted_i
        if req.num_computed_tokens >= len(req.token_ids):
            emitted = output[i, : num_accepted_i + 1].tolist()
            req.token_ids.extend(emitted)
            proposer.append(req.row, emitted)
            is_real[i] = True
    # Penalty rows never draft: the token they emitted is their first.
    rows_gpu = torch.from_numpy(np.asarray([r.row for r in reqs], dtype=np.int32)).to(runner.device)
    runner.sampling_state.record_sampled(
        rows_gpu,
        torch.from_numpy(output[:, 0].copy()).to(runner.device),
        torch.from_numpy(is_real).to(runner.device),
    )
    kept_accepted = num_accepted[is_real]
    emitted_mask = np.arange(output.shape[1])[None, :] <= kept_accepted[:, None]
    logprobs = None
    if sampled.logprobs is not None:
        rows = np.concatenate(
            [np.arange(cu[i], cu[i] + num_accepted[i] + 1) for i in np.flatnonzero(is_real)]
            or [np.zeros(0, np.int64)]
        )
        logprobs = _logprob_rows(sampled, rows)
    num_tokens = int(num_run.sum())
    stats = StepStats(
        step_id=sched.step_id,
        schedule_time_s=sched.schedule_time_s,
        num_reqs=len(reqs),
        num_tokens=num_tokens,
        num_prefill_tokens=num_tokens - int((drafts.num_used + 1)[is_real].sum()),
        prepare_time_s=time.perf_counter() - started,
        spec=spec_stats(
            drafts.num_used[is_real].astype(np.int32), kept_accepted, drafts.token_ids.shape[1]
        ),
    )
    return StepOutput(
        step_id=sched.step_id,
        request_ids=tuple(r for r, k in zip(sched.scheduled_request_ids, is_real) if k),
        sampled_token_ids=output[is_real][emitted_mask],
        logprobs=logprobs,
        stats=stats,
        num_sampled_tokens=(kept_accepted + 1).astype(np.int32),
        num_draft_tokens=drafts.num_used[is_real].astype(np.int32),
    )


def _logprob_rows(sampled: SamplerOutput, rows: np.ndarray) -> LogprobsArrays:
    return LogprobsArrays(
        token_ids=sampled.logprob_token_ids.cpu().numpy()[rows],
        logprobs=sampled.logprobs.cpu().numpy()[rows],
        sampled_rank=sampled.sampled_ranks.cpu().numpy()[rows],
    )
