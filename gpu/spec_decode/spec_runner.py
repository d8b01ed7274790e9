"""The V2 runner's speculative step, launched like any step: nothing waits for the device.

(drafts proposed first when a plain step ran since the last speculative one:
`DeviceDrafts.needs_refresh`, a captured proposal where the tail is graphed) -> forward
(its graph when one holds the step) -> head over the logit rows -> sample, accept,
post-update (gpu/spec_decode/spec_step.py) -> next drafts from the updated history
(gpu/spec_decode/device_drafts.py) -> copy of the emitted tokens to the host.

The tail (head, sampling, acceptance, post-update, drafts) replays a CUDA graph of the
step's padded request count (gpu/spec_decode/spec_graphs.py: K + 1 logit rows per
request, the unused ones never accepted) unless the step needs logit bias, min_tokens,
penalties or logprobs, or no graph holds it; then it runs eagerly over the variable
logit layout (1 + s rows for a request with s draft slots).

A pure-decode speculative step runs none of this: `launch_uniform_step` replays it whole
as one graph, every row padded to K + 1 tokens (gpu/spec_decode/uniform_graphs.py), unless
it needs what the tail graphs lack (above) or no uniform graph holds it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from actors.protocol.messages import SchedulerOutput
from gpu.input_buffers import InputBuffers
from gpu.prompt_logprobs import PromptRequest, plan_prompt_rows
from gpu.runner_v2.states import RequestStates
from gpu.runner_v2.step_plan import GraphSizes, StepPlan, plan_step
from gpu.runner_v2.step_state import V2StepState
from gpu.sampling.sampler import BatchOps, Sampler, batch_ops
from gpu.sampling.state import SamplingState
from gpu.spec_decode.device_drafts import DeviceDrafts
from gpu.spec_decode.spec_graphs import SpecTailGraphs
from gpu.spec_decode.spec_output import SpecCopy, SpecPendingStep
from gpu.spec_decode.spec_step import spec_layout, verify_and_update
from gpu.spec_decode.uniform_graphs import UniformSpecGraphs
from gpu.worker import ModelWorker


class SpecStepRunner(Protocol):
    """What a speculative step uses of the V2 runner (gpu/runner_v2/runner.py)."""

    worker: ModelWorker
    device: torch.device
    step_state: V2StepState
    states: RequestStates
    buffers: InputBuffers
    sampling_state: SamplingState
    sampler: Sampler
    num_logprobs_np: np.ndarray  # [max_num_reqs] int64, -1 without logprobs
    drafts: DeviceDrafts | None
    spec_graphs: SpecTailGraphs | None

    def forward_hidden(self, plan: StepPlan) -> torch.Tensor: ...

    def finish_launch(
        self,
        to_copy: Any,
        sched: SchedulerOutput,
        plan: StepPlan,
        started: float,
        start_event: torch.cuda.Event | None,
    ) -> Any: ...


def launch_spec_step(
    runner: SpecStepRunner,
    sched: SchedulerOutput,
    sizes: GraphSizes | None,
    started: float,
    start_event: torch.cuda.Event | None,
) -> SpecPendingStep:
    """Plan and launch a step with draft slots: whole as a uniform step where one runs it
    (`launch_uniform_step`; `sizes` None: no graph may run it), else as a mixed step."""
    if sizes is not None:
        uniform = launch_uniform_step(runner, sched, started, start_event)
        if uniform is not None:
            return uniform
    plan = plan_step(sched, runner.states.row_of, sizes)
    runner.buffers.upload_step_meta(plan.idx_mapping_np, plan.query_start_loc_np, plan.num_tokens)
    drafts = runner.drafts
    assert drafts is not None
    ops = batch_ops(runner.sampling_state, plan.idx_mapping_np)
    max_num_logprobs = int(runner.num_logprobs_np[plan.idx_mapping_np].max())
    spec_graphs = runner.spec_graphs
    if spec_graphs is not None and not (
        plan.tail_graphed and spec_graphs.holds(plan.num_rows_padded)
    ):
        spec_graphs = None  # no graph of this step's size
    if drafts.needs_refresh(plan.idx_mapping_np, sched.num_draft_slots):
        if spec_graphs is not None:
            spec_graphs.propose(plan.num_rows_padded)
        else:
            drafts.propose(runner.states, runner.buffers.idx_mapping[: plan.num_reqs])
    if spec_graphs is not None and not ops.rewrites_logits and max_num_logprobs < 0:
        to_copy, cu_num_logits_np = (
            _launch_graphed_tail(runner, spec_graphs, sched, plan, ops.filters),
            None,
        )
    else:
        to_copy, cu_num_logits_np = _launch_eager_tail(
            runner, sched, plan, ops, None if max_num_logprobs < 0 else max_num_logprobs
        )
    return _pending_step(
        runner, to_copy, sched, plan, (started, start_event), cu_num_logits_np,
        drafts.num_speculative_tokens,
    )  # fmt: skip


def uniform_shape(
    sched: SchedulerOutput, graphs: UniformSpecGraphs, max_model_len: int
) -> tuple[int, int] | None:
    """(K, padded request count) of `sched` run as a uniform step, or None: some row does
    not decode (a prefill chunk, a row that does not sample), a row would reach
    max_model_len once padded to K + 1 tokens, or no graph holds the step."""
    slots = sched.num_draft_slots
    draft_len = max(slots, default=0)
    if draft_len == 0 or not all(sched.samples_token):
        return None
    if any(n != 1 + s for n, s in zip(sched.num_scheduled_tokens, slots)):
        return None
    # The scheduler's computed counts bound the device's (they count slots in flight).
    if max(sched.num_computed_tokens) + draft_len + 1 > max_model_len:
        return None
    num_reqs_padded = graphs.padded_size(sched.num_reqs, draft_len)
    return None if num_reqs_padded is None else (draft_len, num_reqs_padded)


def launch_uniform_step(
    runner: SpecStepRunner,
    sched: SchedulerOutput,
    started: float,
    start_event: torch.cuda.Event | None,
) -> SpecPendingStep | None:
    """Launch `sched` as a uniform step (one replay, gpu/spec_decode/uniform_graphs.py), or
    return None and launch nothing where it cannot run as one."""
    spec_graphs = runner.spec_graphs
    uniform = None if spec_graphs is None else spec_graphs.uniform
    shape = None if uniform is None else uniform_shape(sched, uniform, runner.worker.max_model_len)
    if shape is None:
        return None
    assert spec_graphs is not None and uniform is not None
    draft_len, num_reqs_padded = shape
    num_reqs = sched.num_reqs
    row_of = runner.states.row_of
    idx_mapping_np = np.fromiter(
        (row_of[r] for r in sched.scheduled_request_ids), dtype=np.int32, count=num_reqs
    )
    ops = batch_ops(runner.sampling_state, idx_mapping_np)
    if ops.rewrites_logits or runner.num_logprobs_np[idx_mapping_np].max() >= 0:
        return None
    num_tokens = num_reqs * (draft_len + 1)
    query_start_loc_np = np.full(num_reqs_padded + 1, num_tokens, dtype=np.int32)
    query_start_loc_np[: num_reqs + 1] = np.arange(num_reqs + 1, dtype=np.int32) * (draft_len + 1)
    runner.buffers.upload_step_meta(idx_mapping_np, query_start_loc_np, num_tokens)
    slots_np = np.asarray(sched.num_draft_slots, dtype=np.int32)
    spec_graphs.upload_slots(slots_np, num_reqs_padded)
    runner.sampling_state.flush_to_device()
    # The graph's output is overwritten by the next replay, possibly before this step's
    # copy to the host has read it: the copy reads a clone.
    packed = uniform.run(num_reqs_padded, draft_len, ops.filters)[:num_reqs].clone()
    # Its rows' histories moved past the drafts it proposed first.
    uniform.drafts.mark_stale()
    num_scheduled = np.asarray(sched.num_scheduled_tokens, dtype=np.int32)
    plan = StepPlan(
        num_reqs,
        int(num_scheduled.sum()),
        draft_len + 1,
        idx_mapping_np,
        query_start_loc_np,
        np.asarray(sched.num_computed_tokens, dtype=np.int32) + num_scheduled,
        None,
        num_reqs_padded,
        True,
    )
    to_copy = SpecCopy(
        packed[:, : draft_len + 1],
        packed[:, draft_len + 1],
        packed[:, draft_len + 2],
        None,
        None,
        None,
    )
    return _pending_step(
        runner, to_copy, sched, plan, (started, start_event), None,
        uniform.drafts.num_speculative_tokens,
    )  # fmt: skip


def _pending_step(
    runner: SpecStepRunner,
    to_copy: SpecCopy,
    sched: SchedulerOutput,
    plan: StepPlan,
    start: tuple[float, torch.cuda.Event | None],  # the launch's start time and event
    cu_num_logits_np: np.ndarray | None,
    num_speculative_tokens: int,
) -> SpecPendingStep:
    """The step's last launches (runner.finish_launch) and its pending outputs."""
    copy, event, stats, timing = runner.finish_launch(to_copy, sched, plan, *start)
    return SpecPendingStep(
        sched.step_id,
        sched.scheduled_request_ids,
        np.asarray(sched.samples_token, dtype=bool),
        copy,
        event,
        stats,
        timing,
        cu_num_logits_np=cu_num_logits_np,
        num_speculative_tokens=num_speculative_tokens,
    )


def _launch_graphed_tail(
    runner: SpecStepRunner,
    spec_graphs: SpecTailGraphs,
    sched: SchedulerOutput,
    plan: StepPlan,
    filters: bool,
) -> SpecCopy:
    """The forward (its graph, or eagerly into the graphs' hidden-state buffer), then the
    tail graph of the step's padded size (gpu/spec_decode/spec_graphs.py)."""
    spec_graphs.upload_slots(
        np.asarray(sched.num_draft_slots, dtype=np.int32), plan.num_rows_padded
    )
    hidden = runner.forward_hidden(plan)
    graph_hidden = runner.step_state.hidden
    if hidden is not graph_hidden:
        graph_hidden[: plan.num_tokens].copy_(hidden[: plan.num_tokens])
    runner.sampling_state.flush_to_device()
    # The graph's output is overwritten by the next replay, possibly before this step's
    # copy to the host has read it: the copy reads a clone.
    packed = spec_graphs.run(plan.num_rows_padded, filters)[: plan.num_reqs].clone()
    num_outputs = spec_graphs.drafts.num_speculative_tokens + 1
    return SpecCopy(
        packed[:, :num_outputs],
        packed[:, num_outputs],
        packed[:, num_outputs + 1],
        None,
        None,
        None,
    )


def _launch_eager_tail(
    runner: SpecStepRunner,
    sched: SchedulerOutput,
    plan: StepPlan,
    ops: BatchOps,
    max_num_logprobs: int | None,
) -> tuple[SpecCopy, np.ndarray]:
    """The forward, then the tail launched op by op over the variable logit layout
    (gpu/spec_decode/spec_step.py); also the layout's cu_num_logits on the host."""
    drafts = runner.drafts
    assert drafts is not None
    num_reqs = plan.num_reqs
    buffers = runner.buffers
    layout = spec_layout(plan, sched.num_draft_slots, runner.device)
    hidden = runner.forward_hidden(plan)
    logits = runner.worker.model.compute_logits(hidden[layout.logits_indices_gpu])
    idx_mapping_gpu = buffers.idx_mapping[:num_reqs]
    sampled = verify_and_update(
        logits,
        layout,
        idx_mapping_gpu,
        buffers.query_start_loc[: num_reqs + 1],
        buffers.positions,
        runner.states,
        runner.sampler,
        drafts,
        ops,
        max_num_logprobs,
    )
    drafts.propose(runner.states, idx_mapping_gpu)
    out = sampled.sampler
    return (
        SpecCopy(
            sampled.output_token_ids,
            sampled.num_accepted,
            sampled.num_draft_tokens,
            out.logprob_token_ids,
            out.logprobs,
            out.sampled_ranks,
        ),
        layout.cu_num_logits_np,
    )


def check_speculative_step(
    sched: SchedulerOutput, prompt_requests: dict[str, PromptRequest]
) -> None:
    """Refuse a step with draft slots that samples under a grammar or scores a prompt: the
    speculative path does neither, and the scheduler never plans such a step
    (actors/core/spec_scheduling.py)."""
    if sched.grammar_bitmask is not None or sched.grammar_mask_deferred:
        raise ValueError(f"step {sched.step_id}: draft slots beside grammar rows")
    if (
        plan_prompt_rows(
            sched.scheduled_request_ids,
            sched.num_computed_tokens,
            sched.num_scheduled_tokens,
            prompt_requests,
        )
        is not None
    ):
        raise ValueError(f"step {sched.step_id}: draft slots beside a prompt to score")
