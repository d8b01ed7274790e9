"""The V2 model runner: GPU-resident request state, inputs built on the device, no sync.

Be paranoid about adding work to `execute`: it runs once per step while the device is
busy with the previous step, and everything here is CPU time the device must hide. Nothing
on this path may wait for the device (`.item()`, `.tolist()`, `.cpu()`, synchronize):
sampled tokens reach the CPU only through `PendingStep.result()`.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from actors.messages import SchedulerOutput, StepStats
from gpu.runner_v2.async_output import PendingStep, StepCopy, copy_to_host
from gpu.runner_v2.input_batch import InputBatch, InputBuffers, build_input_batch
from gpu.runner_v2.states import RequestStates
from gpu.sampling.sampler import Sampler, SamplerOutput
from gpu.sampling.state import SamplingState, unseeded_request_seed
from app.config import EngineConfig
from gpu.worker import ModelWorker
from kernels.post_update import post_update


class ModelRunnerV2:
    name = "v2"

    def __init__(self, worker: ModelWorker, config: EngineConfig | None = None) -> None:
        config = config or worker.config
        self.worker = worker
        self.device = worker.device
        self.block_size = config.block_size
        max_num_reqs = config.max_num_seqs
        self.states = RequestStates(max_num_reqs, worker.max_model_len, worker.max_blocks_per_req,
                                    self.device)
        self.buffers = InputBuffers(max_num_reqs, config.max_num_batched_tokens,
                                    worker.max_blocks_per_req, self.device)
        self.sampling_state = SamplingState(max_num_reqs, worker.model_config.vocab_size, self.device)
        self.sampler = Sampler(self.sampling_state)
        self.num_logprobs_np = np.full(max_num_reqs, -1, dtype=np.int64)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._default_seed = config.seed

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> PendingStep:
        started = time.perf_counter()
        self._sync_states(sched)
        batch = build_input_batch(sched, self.states, self.buffers, self.block_size)
        hidden = self.worker.model(batch.input_ids_gpu, batch.positions_gpu,
                                   self.worker.kv_caches, batch.attn_metadata)
        logits = self.worker.model.compute_logits(hidden[batch.logits_indices_gpu])
        sampled = self._sample(logits, batch)
        self._post_update(batch, sampled)
        copy, event = copy_to_host(StepCopy(sampled.sampled_token_ids, sampled.logprob_token_ids,
                                            sampled.logprobs, sampled.sampled_ranks),
                                   self.copy_stream)
        stats = StepStats(step_id=sched.step_id, num_reqs=batch.num_reqs,
                          num_tokens=batch.num_tokens,
                          num_prefill_tokens=batch.num_tokens - sum(sched.samples_token),
                          prepare_time_s=time.perf_counter() - started)
        return PendingStep(sched.step_id, sched.scheduled_request_ids,
                           np.asarray(sched.samples_token, dtype=bool), copy, event, stats)

    def _sync_states(self, sched: SchedulerOutput) -> None:
        for request_id in sorted(sched.finished_request_ids):
            row = self.states.remove(request_id)
            if row is not None:
                self.sampling_state.remove_request(row)
                self.num_logprobs_np[row] = -1
        for new in sched.new_requests:
            row = self.states.add(new)
            params = new.sampling_params
            self.sampling_state.add_request(
                row, params, new.token_ids[: new.prompt_len], new.token_ids[new.prompt_len:],
                self.worker.eos_token_ids,
                unseeded_request_seed(self._default_seed, new.request_id))
            self.num_logprobs_np[row] = -1 if params.logprobs is None else params.logprobs
        cached = sched.cached_requests
        for request_id, block_ids in zip(cached.request_ids, cached.new_block_ids):
            self.states.append_blocks(request_id, block_ids)
        self.states.apply_staged()
        self.sampling_state.flush_to_device()

    def _sample(self, logits: torch.Tensor, batch: InputBatch) -> SamplerOutput:
        rows = batch.idx_mapping_gpu
        seq_lens = batch.attn_metadata.seq_lens
        num_output_tokens = self.states.total_len_gpu[rows] - self.states.prompt_len_gpu[rows]
        max_num_logprobs = int(self.num_logprobs_np[batch.idx_mapping_np].max())
        return self.sampler(logits, rows, batch.idx_mapping_np, seq_lens.to(torch.int64),
                            num_output_tokens, None if max_num_logprobs < 0 else max_num_logprobs)

    def _post_update(self, batch: InputBatch, sampled: SamplerOutput) -> None:
        is_real = self._samples_real_token(batch)
        post_update(batch.idx_mapping_gpu, batch.query_start_loc_gpu, sampled.sampled_token_ids,
                    self.states.num_computed_gpu, self.states.total_len_gpu,
                    self.states.token_ids_gpu, self.states.last_sampled_gpu,
                    num_reqs=batch.num_reqs)
        self.sampling_state.record_sampled(batch.idx_mapping_gpu, sampled.sampled_token_ids, is_real)

    def _samples_real_token(self, batch: InputBatch) -> torch.Tensor:  # [num_reqs] bool
        rows = batch.idx_mapping_gpu
        return batch.attn_metadata.seq_lens >= self.states.total_len_gpu[rows]
