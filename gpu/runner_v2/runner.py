"""The V2 model runner: GPU-resident request state, inputs built on the device, no sync.

Be paranoid about adding work to `execute`: it runs once per step while the device is
busy with the previous step, and everything here is CPU time the device must hide. Nothing
on this path may wait for the device (`.item()`, `.tolist()`, `.cpu()`, synchronize):
sampled tokens reach the CPU only through `PendingStep.result()`.

Per step the CPU applies the row edits (new requests, new blocks), plans the step's shape
(gpu/runner_v2/step_plan.py), uploads idx_mapping, query_start_loc and the counts in one
copy, and replays the step's CUDA graphs (gpu/cuda_graphs.py): forward, head, sample.
Parts no graph holds run eagerly on the same buffers, with the same kernels.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import structlog
import torch

from actors.protocol.config import EngineConfig
from actors.protocol.messages import SchedulerOutput, StepStats
from gpu.distributed.pipeline import PipelineSampler, SampledReceipt
from gpu.kv_offload import run_kv_transfer
from gpu.prompt_embeds import EmbedsOverlay, RequestEmbeds
from gpu.prompt_logprobs import PromptRequest, plan_prompt_rows, prompt_logprobs
from gpu.runner import LaunchedStep
from gpu.runner_v2.async_output import CopyT, PendingStep, StepCopy, StepTiming, copy_to_host
from gpu.runner_v2.input_batch import build_input_batch
from gpu.runner_v2.received_tokens import ReceivedTokens
from gpu.runner_v2.states_sync import RowSync
from gpu.runner_v2.step_plan import GraphSizes, StepPlan, plan_step
from gpu.sampling.batch_shard import BatchShardedSampler
from gpu.sampling.grammar_mask import DeferredMasks, apply_grammar_bitmask
from gpu.sampling.sampler import BatchOps, SamplerOutput, batch_ops
from gpu.spec_decode.device_drafts import DeviceDrafts
from gpu.spec_decode.spec_capture import spec_tail_graphs_for
from gpu.spec_decode.spec_runner import check_speculative_step, launch_spec_step
from gpu.worker import ModelWorker
from kernels.post_update import post_update

log = structlog.get_logger("tandem.runner_v2")


class ModelRunnerV2:
    name = "v2"
    max_steps_in_flight = 2

    def __init__(self, worker: ModelWorker, config: EngineConfig | None = None) -> None:
        config = config or worker.config
        self.worker = worker
        self.device = worker.device
        self.block_size = config.block_size
        max_num_reqs = config.max_num_seqs
        worker.buffers.check_fits(max_num_reqs, config.max_num_batched_tokens)
        self._claim_step_state(config)
        self.states = self.step_state.states
        self.sampling_state = self.step_state.sampling_state
        self.sampler = self.step_state.sampler
        self.buffers = self.step_state.buffers
        self._graph_sizes: GraphSizes | None = None if self.graphs is None else self.graphs.sizes
        self.num_logprobs_np = np.full(max_num_reqs, -1, dtype=np.int64)
        self._set_up_parallel_sampling()
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._last_end_event: torch.cuda.Event | None = None
        self.prompt_requests: dict[str, PromptRequest] = {}
        """Requests that asked for prompt logprobs."""
        self.deferred_masks = DeferredMasks()
        self.embeds = (
            RequestEmbeds(worker.dtype, self.device) if config.enable_prompt_embeds else None
        )
        self._step_embeds: EmbedsOverlay | None = None
        """The prompt-embedding rows of the step being launched (read by forward_hidden)."""
        self.row_sync = RowSync(
            self.states,
            self.sampling_state,
            self.num_logprobs_np,
            self.prompt_requests,
            self.embeds,
            config.seed,
        )
        self._set_up_speculation(config)

    def _claim_step_state(self, config: EngineConfig) -> None:
        """Take the model's step state (and its CUDA graphs), or a private twin without
        graphs when another V2 runner holds it."""
        self.step_state = self.worker.step_state
        self.graphs = None if config.enforce_eager else self.worker.graphs
        if not self.step_state.try_claim(self, config.max_num_seqs):
            log.warning(
                "v2_step_state_busy",
                reason="another V2 runner holds this model's "
                "step state: this one runs on a private one, without CUDA graphs",
            )
            self.step_state = self.step_state.private_twin()
            self.step_state.try_claim(self, config.max_num_seqs)
            self.graphs = None

    def _set_up_parallel_sampling(self) -> None:
        model = self.worker.model
        # Tensor parallel: each rank's LM head gives its vocabulary slice; the ranks sample
        # the batch between them (gpu/sampling/batch_shard.py).
        self.sharded_sampler = (
            None if model.tp is None else BatchShardedSampler(self.sampler, model.tp)
        )
        # Pipeline parallel: the last stage samples and sends the first stage its tokens;
        # a step per stage is in flight (the scheduler's batch queue).
        stage = model.pp
        self.pipeline_sampler = (
            None
            if stage is None
            else PipelineSampler(stage, self.sharded_sampler or self.sampler, self.device)
        )
        first_stage = stage is not None and stage.is_first
        self.received = ReceivedTokens(self.states) if first_stage else None
        if stage is not None:
            self.max_steps_in_flight = max(self.max_steps_in_flight, stage.pp_size)

    def _set_up_speculation(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        self.spec_graphs = (
            None
            if self.graphs is None
            else spec_tail_graphs_for(self.graphs, self.worker.model, self.step_state, config)
        )
        # With tail graphs, the draft tables are the ones those graphs read and write.
        self.drafts = (
            self.spec_graphs.drafts
            if self.spec_graphs is not None
            else None
            if spec is None
            else DeviceDrafts(spec, config.max_num_seqs, self.device)
        )

    def close(self) -> None:
        """Give the model's step state back (the next runner on this model may take it)."""
        # Every step's outputs were collected here: nothing is awaited but the sampled
        # tables this stage still sends to the others.
        if self.received is not None:
            self.received.clear()
        try:
            if self.pipeline_sampler is not None:
                self.pipeline_sampler.stage.finish_sends()
        finally:
            self.step_state.release(self)

    @property
    def num_free_rows(self) -> int:
        return self.states.num_free_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> LaunchedStep:
        started = time.perf_counter()
        self.step_state.check_owner(self)
        start_event = self._record_event()
        if self.received is not None:  # before rows are read again or freed
            self.received.write_before((*sched.scheduled_request_ids, *sched.finished_request_ids))
        self.row_sync.apply(sched)
        run_kv_transfer(self.worker, sched.kv_transfer)
        if self.drafts is not None:
            sched = self.drafts.trim_slots(sched, self.states)
            if any(sched.num_draft_slots):
                check_speculative_step(sched, self.prompt_requests)
        self._step_embeds = (
            None
            if self.embeds is None
            else self.embeds.overlay(
                sched.scheduled_request_ids, sched.num_computed_tokens, sched.num_scheduled_tokens
            )
        )
        # The graphs read token ids only: a step with prompt-embedding rows runs eagerly.
        sizes = self._graph_sizes if self._step_embeds is None else None
        if self.drafts is not None and any(sched.num_draft_slots):
            return launch_spec_step(self, sched, sizes, started, start_event)
        plan = plan_step(sched, self.states.row_of, sizes)
        self.buffers.upload_step_meta(plan.idx_mapping_np, plan.query_start_loc_np, plan.num_tokens)
        if self.drafts is not None:
            self.drafts.mark_stale()
        sampled, hidden = self._run(plan, sched)
        prompt_rows = plan_prompt_rows(
            sched.scheduled_request_ids,
            sched.num_computed_tokens,
            sched.num_scheduled_tokens,
            self.prompt_requests,
        )
        prompt = (
            None
            if prompt_rows is None  # blocking copy: in such steps only
            else self._prompt_logprobs(hidden, prompt_rows)
        )
        copy, event, stats, timing = self.finish_launch(
            sampled if isinstance(sampled, SampledReceipt) else StepCopy.of(sampled),
            sched,
            plan,
            started,
            start_event,
        )
        return PendingStep(
            sched.step_id,
            sched.scheduled_request_ids,
            np.asarray(sched.samples_token, dtype=bool),
            copy,
            event,
            stats,
            timing,
            prompt,
        )

    def finish_launch(
        self,
        to_copy: CopyT,
        sched: SchedulerOutput,
        plan: StepPlan,
        started: float,
        start_event: torch.cuda.Event | None,
    ) -> tuple[CopyT, torch.cuda.Event | None, StepStats, StepTiming | None]:
        """The step's last launches: its end event and the copy of its results to the host;
        and its stats."""
        end_event = self._record_event()
        if isinstance(to_copy, SampledReceipt):  # a first pipeline stage's tokens, to come
            arrived = to_copy.to_host(self.copy_stream)
            copy, event = (lambda: StepCopy.of(arrived())), None
        else:
            copy, event = copy_to_host(to_copy, self.copy_stream)
        num_decode_tokens = sum(sched.samples_token) + sum(sched.num_draft_slots)
        stats = StepStats(
            step_id=sched.step_id,
            schedule_time_s=sched.schedule_time_s,
            num_reqs=plan.num_reqs,
            num_tokens=plan.num_tokens,
            num_prefill_tokens=plan.num_tokens - num_decode_tokens,
            prepare_time_s=time.perf_counter() - started,
        )
        timing = StepTiming(start_event, end_event, self._last_end_event) if end_event else None
        self._last_end_event = end_event
        return copy, event, stats, timing

    def _run(
        self, plan: StepPlan, sched: SchedulerOutput
    ) -> tuple[SamplerOutput | SampledReceipt, torch.Tensor]:
        """Forward, head and sampling of one planned step: graphs where they hold it; also
        the step's hidden states ([num_tokens, hidden_size]). The grammar mask rewrites the
        head's logits in place between the head and the sample graphs, so constrained
        steps keep every graph; a deferred mask is waited for once the forward and head
        are launched, so the device runs them meanwhile."""
        num_reqs = plan.num_reqs
        ops = batch_ops(self.sampling_state, plan.idx_mapping_np)
        max_num_logprobs = int(self.num_logprobs_np[plan.idx_mapping_np].max())
        sampler = self.pipeline_sampler or self.sharded_sampler
        if sampler is not None:  # structured outputs are refused under TP and PP
            hidden = self.forward_hidden(plan)[: plan.num_tokens]
            return self._sample_eagerly(
                self._distributed_logits(hidden, plan),
                plan,
                ops,
                None if max_num_logprobs < 0 else max_num_logprobs,
                sampler,
                sched,
            ), hidden
        logits, hidden = self._logits(plan)
        apply_grammar_bitmask(logits, self.deferred_masks.step_mask(sched))
        if plan.tail_graphed and not ops.rewrites_logits and max_num_logprobs < 0:
            self.sampling_state.flush_to_device()
            # The graph's output is overwritten by the next replay, possibly before this
            # step's copy to the host has read it: the copy reads a clone.
            sampled = self.graphs.run_sample(plan.num_rows_padded, ops.filters)[:num_reqs].clone()
            return SamplerOutput(sampled, None, None, None), hidden
        return self._sample_eagerly(
            logits[:num_reqs], plan, ops, None if max_num_logprobs < 0 else max_num_logprobs
        ), hidden

    def _logits(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """[>= num_reqs, vocab_size] float32 logits, [num_tokens, hidden_size] hidden."""
        if plan.forward is not None:
            self.graphs.run_forward(plan.forward)
            hidden = self.step_state.hidden[: plan.num_tokens]
            return self.graphs.run_head(plan.num_rows_padded), hidden
        hidden = self.forward_hidden(plan)[: plan.num_tokens]
        logits_indices = self.buffers.query_start_loc[1 : plan.num_reqs + 1].long() - 1
        out = self.step_state.logits[: plan.num_reqs] if plan.tail_graphed else None
        return self.worker.model.compute_logits(hidden[logits_indices], out=out), hidden

    def forward_hidden(self, plan: StepPlan) -> torch.Tensor:  # [>= num_tokens, hidden_size]
        """The step's forward (its graph, or eagerly): every token's final hidden state."""
        if plan.forward is not None:
            self.graphs.run_forward(plan.forward)
            return self.step_state.hidden
        batch = build_input_batch(plan, self.states, self.buffers, self.block_size)
        return self.worker.model(
            batch.input_ids_gpu,
            batch.positions_gpu,
            self.worker.kv_caches,
            batch.attn_metadata,
            embeds=self._step_embeds,
        )

    def _distributed_logits(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        plan: StepPlan,
    ) -> torch.Tensor | None:
        """The logits a TP or PP rank's sampler takes: under TP, this rank's vocabulary
        slice [tp_size * rows_per_rank, vocab shard] float32 in the batch-sharded sampler's
        owner-major order; [num_reqs, vocab_size] on the last stage of a pipeline without
        TP; None on the other stages. The forward graphs (their all-reduces captured)
        serve TP steps; the head and sampling run eagerly."""
        if self.pipeline_sampler is not None and not self.pipeline_sampler.stage.is_last:
            return None
        logits_indices = self.buffers.query_start_loc[1 : plan.num_reqs + 1].long() - 1
        if self.sharded_sampler is None:
            return self.worker.model.compute_logits(hidden[logits_indices])
        order = self.sharded_sampler.logits_row_order(plan.num_reqs)
        return self.worker.model.compute_logits_local(hidden[logits_indices[order]]).float()

    def _sample_eagerly(
        self,
        logits: torch.Tensor | None,  # None on a pipeline stage without the head
        plan: StepPlan,
        ops: BatchOps,
        max_num_logprobs: int | None,
        sampler: Any = None,
        sched: SchedulerOutput | None = None,
    ) -> SamplerOutput | SampledReceipt:
        num_reqs = plan.num_reqs
        rows = self.buffers.idx_mapping[:num_reqs]
        seq_lens = self.buffers.seq_lens[:num_reqs]
        num_output_tokens = self.states.total_len_gpu[rows] - self.states.prompt_len_gpu[rows]
        sampled = (sampler or self.sampler)(
            logits,
            rows,
            plan.idx_mapping_np,
            seq_lens.to(torch.int64),
            num_output_tokens,
            max_num_logprobs,
            ops=ops,
        )
        if isinstance(sampled, SampledReceipt):  # a first pipeline stage: it never samples
            assert self.received is not None and sched is not None
            length_before = self.received.length_before(rows)
            self._post_update(rows, num_reqs, self.received.placeholders(num_reqs))
            self.received.record(sampled, rows, length_before, sched)
            return sampled
        # Only penalty rows read the output counts, and a penalty row's counts are rebuilt
        # from its history when it joins: count only in steps that hold such a row (every
        # step it runs in). The chunk reaching the last known token makes the sample real.
        is_real = seq_lens >= self.states.total_len_gpu[rows] if ops.penalties else None
        self._post_update(rows, num_reqs, sampled.sampled_token_ids)
        if is_real is not None:
            self.sampling_state.record_sampled(rows, sampled.sampled_token_ids, is_real)
        return sampled

    def _post_update(
        self,
        rows: torch.Tensor,  # [num_reqs] int32
        num_reqs: int,
        sampled_token_ids: torch.Tensor,  # [num_reqs] int64
    ) -> None:
        post_update(
            rows,
            self.buffers.query_start_loc[: num_reqs + 1],
            sampled_token_ids,
            self.states.num_computed_gpu,
            self.states.total_len_gpu,
            self.states.token_ids_gpu,
            self.states.last_sampled_gpu,
            num_reqs=num_reqs,
        )

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        prompt_rows: Any,
    ) -> Any:
        """The step's prompt logprobs (gpu/prompt_logprobs.py); under PP the last stage
        computes them and every rank returns its result."""
        stage = self.worker.model.pp
        if stage is None:
            return prompt_logprobs(self.worker.model.compute_logits, hidden, prompt_rows)
        computed = (
            prompt_logprobs(self.worker.model.compute_logits, hidden, prompt_rows)
            if stage.is_last
            else None
        )
        return stage.share_object(computed)

    def _record_event(self) -> torch.cuda.Event | None:
        """A timing event on the main stream; the completion thread reads it once the
        step's outputs have arrived, so reading it never waits."""
        if self.copy_stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
