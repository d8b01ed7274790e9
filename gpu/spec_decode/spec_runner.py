"""The V2 runner's speculative step, launched like any step: nothing waits for the device.

forward (its graph when one holds the step) -> head over the logit rows -> sample, accept,
post-update (gpu/spec_decode/spec_step.py) -> next drafts from the updated history
(gpu/spec_decode/device_drafts.py) -> copy of the emitted tokens to the host.

The head, sampling and post-update run eagerly: the whole-step graphs hold one logit row
per request, and a speculative step has up to 1 + K.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from actors.messages import SchedulerOutput
from gpu.prompt_logprobs import PromptRequest, plan_prompt_rows
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


def check_speculative_step(sched: SchedulerOutput, prompt_requests: dict[str, PromptRequest]
                           ) -> None:
    """Refuse a step with draft slots that samples under a grammar or scores a prompt: the
    speculative path does neither, and the scheduler never plans such a step
    (actors/spec_scheduling.py)."""
    if sched.grammar_bitmask is not None or sched.grammar_mask_deferred:
        raise ValueError(f"step {sched.step_id}: draft slots beside grammar rows")
    if plan_prompt_rows(sched.scheduled_request_ids, sched.num_computed_tokens,
                        sched.num_scheduled_tokens, prompt_requests) is not None:
        raise ValueError(f"step {sched.step_id}: draft slots beside a prompt to score")
