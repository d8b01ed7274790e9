"""The V2 runner's speculative step, launched like any step: nothing waits for the device.

forward (its graph when one holds the step) -> head over the logit rows -> sample, accept,
post-update (gpu/spec_decode/spec_step.py) -> next drafts from the updated history
(gpu/spec_decode/device_drafts.py) -> copy of the emitted tokens to the host.

The head, sampling and post-update run eagerly: the whole-step graphs hold one logit row
per request, and a speculative step has up to 1 + K.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from actors.messages import SchedulerOutput
from gpu.runner_v2.step_plan import StepPlan
from gpu.sampling.sampler import batch_ops
from gpu.spec_decode.spec_output import SpecCopy, SpecPendingStep
from gpu.spec_decode.spec_step import spec_layout, verify_and_update

if TYPE_CHECKING:
    from gpu.runner_v2.runner import ModelRunnerV2


def launch_spec_step(runner: ModelRunnerV2, sched: SchedulerOutput, plan: StepPlan,
                     started: float, start_event: torch.cuda.Event | None) -> SpecPendingStep:
    drafts = runner.drafts
    assert drafts is not None
    num_reqs = plan.num_reqs
    buffers = runner.buffers
    layout = spec_layout(plan, sched.num_draft_slots, runner.device)
    hidden = runner.forward_hidden(plan)
    logits = runner.worker.model.compute_logits(hidden[layout.logits_indices_gpu])
    max_num_logprobs = int(runner.num_logprobs_np[plan.idx_mapping_np].max())
    idx_mapping_gpu = buffers.idx_mapping[:num_reqs]
    sampled = verify_and_update(
        logits, layout, idx_mapping_gpu, buffers.query_start_loc[:num_reqs + 1],
        buffers.positions, runner.states, runner.sampler, drafts,
        batch_ops(runner.sampling_state, layout.logit_rows_np),
        None if max_num_logprobs < 0 else max_num_logprobs)
    drafts.propose(runner.states, idx_mapping_gpu)
    out = sampled.sampler
    copy, event, stats, timing = runner.finish_launch(
        SpecCopy(sampled.output_token_ids, sampled.num_accepted, sampled.num_draft_tokens,
                 out.logprob_token_ids, out.logprobs, out.sampled_ranks),
        sched, plan, started, start_event)
    return SpecPendingStep(sched.step_id, sched.scheduled_request_ids,
                           np.asarray(sched.samples_token, dtype=bool), copy, event, stats,
                           timing, cu_num_logits_np=layout.cu_num_logits_np,
                           num_speculative_tokens=drafts.num_speculative_tokens)


def without_draft_slots(sched: SchedulerOutput) -> SchedulerOutput:
    """`sched` with every row cut to its last token (no draft slots); the scheduler's
    correction counts from the tokens emitted, so it needs no other change."""
    if not any(sched.num_draft_slots):
        return sched
    num_scheduled = tuple(n - k for n, k in zip(sched.num_scheduled_tokens, sched.num_draft_slots,
                                                strict=True))
    return msgspec.structs.replace(sched, num_scheduled_tokens=num_scheduled,
                                   num_draft_slots=(0,) * len(sched.num_draft_slots))


def runs_without_drafts(sched: SchedulerOutput, prompt_request_ids: Collection[str]) -> bool:
    """Steps with grammar rows or prompt-logprob rows run without draft slots: the
    speculative path applies no grammar mask and scores no prompt."""
    if not any(sched.num_draft_slots):
        return False
    return (sched.grammar_bitmask is not None or sched.grammar_mask_deferred
            or (bool(prompt_request_ids)
                and any(r in prompt_request_ids for r in sched.scheduled_request_ids)))
