"""The V1 model runner: the fallback when V2 cannot serve a configuration.

Each step the batch is rebuilt on the CPU with numpy from per-request Python state, copied
to the device, run, and the sampled tokens are synchronised back to the CPU before the step
returns: simple, no overlap. Same model, attention and sampling semantics as V2, so greedy
outputs are identical.

Two features only this runner has: --compile-level (the model's token-wise layers
compiled with torch.compile, gpu/runner_v1/compiled_model.py) and custom logits
processors (actors/protocol/logits_processors.py, driven by gpu/runner_v1/logits_processors.py),
which see each step's logits before the sampler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from actors.protocol.config import EngineConfig
from actors.protocol.logits_processors import LogitsProcessorConfig
from actors.protocol.messages import (
    LogprobsArrays,
    PromptLogprobs,
    SchedulerOutput,
    StepOutput,
    StepStats,
)
from gpu.attention.base import AttentionMetadata
from gpu.kv_offload import run_kv_transfer
from gpu.prompt_embeds import EmbedsOverlay, embeds_tensor, step_overlay
from gpu.prompt_logprobs import PromptRequest, plan_prompt_rows, prompt_logprobs
from gpu.runner import ReadyStep
from gpu.runner_v1.compiled_model import compiled_decoder
from gpu.runner_v1.logits_processors import LogitsProcessorBatch
from gpu.sampling.grammar_mask import DeferredMasks, apply_grammar_bitmask
from gpu.sampling.sampler import Sampler, SamplerOutput
from gpu.sampling.state import SamplingState
from gpu.spec_decode.ngram_proposer import NgramProposer
from gpu.spec_decode.spec_runner import check_speculative_step
from gpu.spec_decode.v1_spec import execute_spec_step
from gpu.worker import ModelWorker
from kernels.topk_logprobs import topk_logprobs


@dataclass(slots=True)
class _CachedRequest:
    row: int
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_logprobs: int
    num_computed_tokens: int = 0
    embeds: torch.Tensor | None = None
    """[prompt_len, hidden_size]: the prompt's rows when it was given as embeddings."""


class _StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_reqs] int64
    rows_np: np.ndarray  # [num_reqs] int32
    rows_gpu: torch.Tensor  # [num_reqs] int32
    sample_positions: torch.Tensor  # [num_reqs] int64: where each sampled token goes
    num_output_tokens: torch.Tensor  # [num_reqs] int32
    embeds: EmbedsOverlay | None


class ModelRunnerV1:
    name = "v1"
    max_steps_in_flight = 1

    def __init__(self, worker: ModelWorker, config: EngineConfig | None = None) -> None:
        self.worker = worker
        self.device = worker.device
        self.block_size = worker.config.block_size
        config = config or worker.config
        max_num_reqs = config.max_num_seqs
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, _CachedRequest] = {}
        self.sampling_state = SamplingState(
            max_num_reqs, worker.model_config.vocab_size, self.device
        )
        self.sampler = Sampler(self.sampling_state)
        self._default_seed = config.seed
        self.forward = (
            worker.model
            if config.compile_level == 0
            else compiled_decoder(worker.model, config.compile_level)
        )
        self.logits_processors = _load_logits_processors(worker, config)
        self._prompt_requests: dict[str, PromptRequest] = {}
        """Requests that asked for prompt logprobs."""
        self.deferred_masks = DeferredMasks()
        """Never used with one step in flight: every mask comes with its step."""
        spec = config.speculative_config
        self.proposer = (
            None if spec is None else NgramProposer(spec, max_num_reqs, worker.max_model_len)
        )

    def execute(self, sched: SchedulerOutput) -> ReadyStep:
        """Run the step to its sampled tokens on the host (gpu.runner.Runner)."""
        return ReadyStep(self._run_step(sched), sched.scheduled_request_ids)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def close(self) -> None:
        """Nothing to give back: the V1 runner's state is its own."""

    @torch.inference_mode()
    def _run_step(self, sched: SchedulerOutput) -> StepOutput:
        started = time.perf_counter()
        self._update_states(sched)
        run_kv_transfer(self.worker, sched.kv_transfer)
        if self.proposer is not None and any(sched.num_draft_slots):
            check_speculative_step(sched, self._prompt_requests)
            return execute_spec_step(self, sched, started)
        reqs = [self.requests[r] for r in sched.scheduled_request_ids]
        num_scheduled = np.asarray(sched.num_scheduled_tokens, dtype=np.int64)
        inputs = self.build_inputs(reqs, num_scheduled)
        hidden = self.run_model(inputs)
        # A pipeline stage without the head has no logits: the last stage's tokens arrive
        # in _sample.
        logits = (
            self.worker.model.compute_logits(hidden[inputs.logits_indices])
            if self.worker.model.has_head
            else None
        )
        if logits is not None:
            apply_grammar_bitmask(logits, self.deferred_masks.step_mask(sched))
        rows = plan_prompt_rows(
            sched.scheduled_request_ids,
            sched.num_computed_tokens,
            sched.num_scheduled_tokens,
            self._prompt_requests,
        )
        prompt = None if rows is None else self._prompt_logprobs(hidden, rows)
        max_num_logprobs = max(r.num_logprobs for r in reqs)
        out = self._sample(
            logits,
            sched.scheduled_request_ids,
            inputs,
            None if max_num_logprobs < 0 else max_num_logprobs,
        )
        sampled_np = out.sampled_token_ids.cpu().numpy()  # V1 synchronises every step
        is_real_np = self._advance(reqs, num_scheduled, sampled_np)
        if self.proposer is not None:
            for req, token, is_real in zip(reqs, sampled_np.tolist(), is_real_np):
                if is_real:
                    self.proposer.append(req.row, (token,))
        if self.logits_processors is not None:
            for request_id, token, is_real in zip(
                sched.scheduled_request_ids, sampled_np, is_real_np
            ):
                if is_real:
                    self.logits_processors.append_output(request_id, int(token))
        self.sampling_state.record_sampled(
            inputs.rows_gpu, out.sampled_token_ids, torch.from_numpy(is_real_np).to(self.device)
        )
        stats = StepStats(
            step_id=sched.step_id,
            schedule_time_s=sched.schedule_time_s,
            num_reqs=len(reqs),
            num_tokens=int(num_scheduled.sum()),
            num_prefill_tokens=int(num_scheduled.sum() - is_real_np.sum()),
            prepare_time_s=time.perf_counter() - started,
        )
        return _step_output(sched, is_real_np, sampled_np, out, stats, prompt)

    def run_model(self, inputs: _StepInputs) -> torch.Tensor:  # [num_tokens, hidden_size]
        if inputs.embeds is None:  # the compiled model reads token ids only
            return self.forward(
                inputs.input_ids, inputs.positions, self.worker.kv_caches, inputs.attn_metadata
            )
        return self.worker.model(
            inputs.input_ids,
            inputs.positions,
            self.worker.kv_caches,
            inputs.attn_metadata,
            embeds=inputs.embeds,
        )

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rows: Any,
    ) -> Any:
        """The step's prompt logprobs; under pipeline parallelism the last stage computes
        them and every rank returns its result."""
        stage = self.worker.model.pp
        computed = (
            prompt_logprobs(self.worker.model.compute_logits, hidden, rows)
            if self.worker.model.has_head
            else None
        )
        return computed if stage is None else stage.share_object(computed)

    def _sample(
        self,
        logits: torch.Tensor | None,  # [num_reqs, vocab_size] float32; None without the head
        request_ids: tuple[str, ...],  # the requests of the logit rows
        inputs: _StepInputs,
        max_num_logprobs: int | None,
    ) -> SamplerOutput:
        """The step's tokens: sampled here, or under pipeline parallelism by the last
        stage and shared with every rank."""
        stage = self.worker.model.pp
        sampled = (
            None
            if logits is None
            else self._sample_logits(logits, request_ids, inputs, max_num_logprobs)
        )
        if stage is None:
            assert sampled is not None
            return sampled
        return stage.share_sampled(sampled, len(inputs.rows_np), max_num_logprobs, self.device)

    def _sample_logits(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab_size] float32, the model's
        request_ids: tuple[str, ...],  # the requests of the logit rows
        inputs: _StepInputs,
        max_num_logprobs: int | None,
    ) -> SamplerOutput:
        """Custom logits processors first (when configured), then the sampler; logprobs
        stay those of the model's logits."""
        if self.logits_processors is None:
            return self.sampler(
                logits,
                inputs.rows_gpu,
                inputs.rows_np,
                inputs.sample_positions,
                inputs.num_output_tokens,
                max_num_logprobs,
            )
        all_greedy = bool((self.sampling_state.temperature_np[inputs.rows_np] == 0.0).all())
        # Processors may write in place; logprobs still need the model's logits then.
        raw = logits if max_num_logprobs is None else logits.clone()
        processed = self.logits_processors.apply(logits, request_ids, all_greedy)
        out = self.sampler(
            processed,
            inputs.rows_gpu,
            inputs.rows_np,
            inputs.sample_positions,
            inputs.num_output_tokens,
            None,
        )
        if max_num_logprobs is None:
            return out
        token_ids, logprobs, ranks = topk_logprobs(raw, out.sampled_token_ids, max_num_logprobs)
        return SamplerOutput(out.sampled_token_ids, token_ids, logprobs, ranks)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for request_id in sorted(sched.finished_request_ids):
            req = self.requests.pop(request_id, None)
            self._prompt_requests.pop(request_id, None)
            if req is not None:
                self._free_rows.append(req.row)
                self.sampling_state.remove_request(req.row)
            if self.logits_processors is not None:
                self.logits_processors.remove_request(request_id)
        for new in sched.new_requests:
            row = self._free_rows.pop()
            params = new.sampling_params
            if params.prompt_logprobs is not None:
                self._prompt_requests[new.request_id] = PromptRequest(
                    params.prompt_logprobs, new.token_ids[: new.prompt_len]
                )
            self.requests[new.request_id] = _CachedRequest(
                row=row,
                token_ids=list(new.token_ids),
                prompt_len=new.prompt_len,
                block_ids=list(new.block_ids),
                num_logprobs=-1 if params.logprobs is None else params.logprobs,
                num_computed_tokens=new.num_computed_tokens,
                embeds=(
                    None
                    if new.prompt_embeds is None
                    else embeds_tensor(new.prompt_embeds, self.worker.dtype)
                ),
            )
            self.sampling_state.add_new_request(row, new, self._default_seed)
            if self.proposer is not None:
                self.proposer.add_request(row, new.token_ids)
            if self.logits_processors is not None:
                self.logits_processors.add_request(
                    new.request_id,
                    params,
                    new.token_ids[: new.prompt_len],
                    new.token_ids[new.prompt_len :],
                )
        cached = sched.cached_requests
        for request_id, block_ids in zip(cached.request_ids, cached.new_block_ids):
            self.requests[request_id].block_ids.extend(block_ids)
        self.sampling_state.flush_to_device()

    def build_inputs(self, reqs: list[_CachedRequest], num_scheduled: np.ndarray) -> _StepInputs:
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        starts = np.asarray([r.num_computed_tokens for r in reqs], dtype=np.int64)
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, num_scheduled)])
        input_ids = np.concatenate(
            [r.token_ids[s : s + n] for r, s, n in zip(reqs, starts, num_scheduled)]
        )
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_table = np.zeros((len(reqs), max_blocks), dtype=np.int32)
        for i, r in enumerate(reqs):
            block_table[i, : len(r.block_ids)] = r.block_ids
        req_index = np.repeat(np.arange(len(reqs)), num_scheduled)
        slots = (
            block_table[req_index, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        seq_lens = (starts + num_scheduled).astype(np.int32)
        rows = np.asarray([r.row for r in reqs], dtype=np.int32)
        num_output = np.asarray([len(r.token_ids) - r.prompt_len for r in reqs], dtype=np.int32)
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=len(positions),
            num_reqs=len(reqs),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            slot_mapping=torch.from_numpy(slots.astype(np.int64)).to(dev),
            block_table=torch.from_numpy(block_table).to(dev),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return _StepInputs(
            input_ids=torch.from_numpy(np.asarray(input_ids, dtype=np.int64)).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            attn_metadata=metadata,
            logits_indices=torch.from_numpy(query_start_loc[1:].astype(np.int64) - 1).to(dev),
            rows_np=rows,
            rows_gpu=torch.from_numpy(rows).to(dev),
            sample_positions=torch.from_numpy(seq_lens.astype(np.int64)).to(dev),
            num_output_tokens=torch.from_numpy(num_output).to(dev),
            embeds=step_overlay([r.embeds for r in reqs], starts, num_scheduled, dev),
        )

    @staticmethod
    def _advance(
        reqs: list[_CachedRequest], num_scheduled: np.ndarray, sampled_np: np.ndarray
    ) -> np.ndarray:
        is_real = np.zeros(len(reqs), dtype=bool)
        for i, (req, n) in enumerate(zip(reqs, num_scheduled)):
            req.num_computed_tokens += int(n)
            if req.num_computed_tokens >= len(req.token_ids):
                req.token_ids.append(int(sampled_np[i]))
                is_real[i] = True
        return is_real


def _load_logits_processors(
    worker: ModelWorker, config: EngineConfig
) -> LogitsProcessorBatch | None:
    if not config.logits_processors:
        return None
    processor_config = LogitsProcessorConfig(
        vocab_size=worker.model_config.vocab_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=worker.max_model_len,
        model=config.model,
    )
    return LogitsProcessorBatch.load(config.logits_processors, processor_config, worker.device)


def _step_output(
    sched: SchedulerOutput,
    is_real: np.ndarray,
    sampled_np: np.ndarray,
    out,
    stats: StepStats,
    prompt: PromptLogprobs | None,
) -> StepOutput:
    request_ids = tuple(r for r, k in zip(sched.scheduled_request_ids, is_real) if k)
    logprobs = None
    if out.logprobs is not None:
        logprobs = LogprobsArrays(
            token_ids=out.logprob_token_ids.cpu().numpy()[is_real],
            logprobs=out.logprobs.cpu().numpy()[is_real],
            sampled_rank=out.sampled_ranks.cpu().numpy()[is_real],
        )
    return StepOutput(
        step_id=sched.step_id,
        request_ids=request_ids,
        sampled_token_ids=sampled_np[is_real],
        logprobs=logprobs,
        stats=stats,
        prompt_logprobs=prompt,
    )
