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
from gpu.runner_v2.async_output import PendingStep, StepCopy, StepTiming, copy_to_host
from gpu.runner_v2.input_batch import InputBatch, build_input_batch
from gpu.runner_v2.states import RequestStates
from gpu.sampling.sampler import Sampler, SamplerOutput
from gpu.sampling.state import SamplingState, unseeded_request_seed
from actors.config import EngineConfig
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
        if max_num_reqs > worker.buffers.max_num_reqs \
                or config.max_num_batched_tokens > worker.buffers.max_num_tokens:
            raise ValueError(
                f"the runner's max_num_seqs {max_num_reqs} / max_num_batched_tokens "
                f"{config.max_num_batched_tokens} exceed the loaded model's "
                f"{worker.buffers.max_num_reqs} / {worker.buffers.max_num_tokens}")
        self.states = RequestStates(max_num_reqs, worker.max_model_len, worker.max_blocks_per_req,
                                    self.device)
        self.buffers = worker.buffers
        self.graphs = None if config.enforce_eager else worker.graphs
        self.sampling_state = SamplingState(max_num_reqs, worker.model_config.vocab_size, self.device)
        self.sampler = Sampler(self.sampling_state)
        self.num_logprobs_np = np.full(max_num_reqs, -1, dtype=np.int64)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._last_end_event: torch.cuda.Event | None = None
        self._default_seed = config.seed

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> PendingStep:
        started = time.perf_counter()
        start_event = self._record_event()
        self._sync_states(sched)
        batch = build_input_batch(sched, self.states, self.buffers, self.block_size, self.graphs)
        logits = self._forward(batch)
        sampled = self._sample(logits, batch)
        self._post_update(batch, sampled)
        end_event = self._record_event()
        copy, event = copy_to_host(StepCopy(sampled.sampled_token_ids, sampled.logprob_token_ids,
                                            sampled.logprobs, sampled.sampled_ranks),
                                   self.copy_stream)
        stats = StepStats(step_id=sched.step_id, schedule_time_s=sched.schedule_time_s,
                          num_reqs=batch.num_reqs,
                          num_tokens=batch.num_tokens,
                          num_prefill_tokens=batch.num_tokens - sum(sched.samples_token),
                          prepare_time_s=time.perf_counter() - started)
        timing = StepTiming(start_event, end_event, self._last_end_event) if end_event else None
        self._last_end_event = end_event
        return PendingStep(sched.step_id, sched.scheduled_request_ids,
                           np.asarray(sched.samples_token, dtype=bool), copy, event, stats, timing)

    def _forward(self, batch: InputBatch) -> torch.Tensor:  # [num_reqs, vocab_size] float32
        model = self.worker.model
        if batch.num_reqs_padded is not None and self.graphs is not None:
            return model.compute_logits(self.graphs.run(batch.num_reqs))
        hidden = model(batch.input_ids_gpu, batch.positions_gpu, self.worker.kv_caches,
                       batch.attn_metadata)
        return model.compute_logits(hidden[batch.logits_indices_gpu])

    def _record_event(self) -> torch.cuda.Event | None:
        """A timing event on the main stream; the completion thread reads it once the
        step's outputs have arrived, so reading it never waits."""
        if self.copy_stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

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
                new.eos_token_ids,
                unseeded_request_seed(self._default_seed, new.request_id))
            self.num_logprobs_np[row] = -1 if params.logprobs is None else params.logprobs
        cached = sched.cached_requests
        for request_id, block_ids in zip(cached.request_ids, cached.new_block_ids):
            self.states.append_blocks(request_id, block_ids)
        self.states.apply_staged()
        self.sampling_state.flush_to_device()

    def _sample(self, logits: torch.Tensor, batch: InputBatch) -> SamplerOutput:
        rows = batch.idx_mapping_gpu
        num_output_tokens = self.states.total_len_gpu[rows] - self.states.prompt_len_gpu[rows]
        max_num_logprobs = int(self.num_logprobs_np[batch.idx_mapping_np].max())
        return self.sampler(logits, rows, batch.idx_mapping_np, batch.seq_lens_gpu.to(torch.int64),
                            num_output_tokens, None if max_num_logprobs < 0 else max_num_logprobs)

    def _post_update(self, batch: InputBatch, sampled: SamplerOutput) -> None:
        # Only penalties read the output counts; skip their launches when no row uses them.
        is_real = (self._samples_real_token(batch)
                   if self.sampling_state.output_counts_gpu is not None else None)
        post_update(batch.idx_mapping_gpu, batch.query_start_loc_gpu, sampled.sampled_token_ids,
                    self.states.num_computed_gpu, self.states.total_len_gpu,
                    self.states.token_ids_gpu, self.states.last_sampled_gpu,
                    num_reqs=batch.num_reqs)
        if is_real is not None:
            self.sampling_state.record_sampled(batch.idx_mapping_gpu, sampled.sampled_token_ids,
                                               is_real)

    def _samples_real_token(self, batch: InputBatch) -> torch.Tensor:  # [num_reqs] bool
        # Before post_update: the chunk reaching the last known token makes the sample real.
        rows = batch.idx_mapping_gpu
        return batch.seq_lens_gpu >= self.states.total_len_gpu[rows]
