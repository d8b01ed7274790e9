"""Drive tandem's V2 model runner directly with hand-built SchedulerOutputs: a fixed batch of
requests prefilled to a chosen context, then decode steps (optionally each with one fresh
prefill chunk beside the decodes, as under serving load). No scheduler, no actors: what is
timed is the runner and the device.

Imports tandem from whatever tree is first on sys.path, and only the runner API that every
version keeps (ModelWorker(config, platform), ModelRunnerV2(worker, config).execute(sched)
-> PendingStep, .result() -> StepOutput), so one script can profile two checkouts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Batch:
    request_ids: list[str]
    num_computed: list[int]
    params: Any
    prefill_blocks: tuple[int, ...]
    prefill_len: int = 0
    prefill_seq: int = 0
    pending_finished: set[str] = field(default_factory=set)


class RunnerDriver:
    def __init__(self, model: str, engine: dict[str, Any]) -> None:
        import gpu
        from gpu.platform import probe_platform
        from gpu.runner_v2.runner import ModelRunnerV2
        from gpu.worker import ModelWorker

        self.source_dir = str(next(iter(gpu.__path__)))
        self.config = _engine_config_class()(model=model, runner="v2", **engine)
        self.worker = ModelWorker(self.config, probe_platform(self.config.device))
        self.runner = ModelRunnerV2(self.worker, self.config)
        self.block_size = self.config.block_size
        self.vocab_size = self.worker.model_config.vocab_size
        self._next_block = 0
        self._step_id = 0
        self._to_free: set[str] = set()  # rows the next step frees
        self._rng = np.random.default_rng(0)

    # ---- building steps -------------------------------------------------------------------

    def _blocks(self, num_tokens: int) -> tuple[int, ...]:
        count = -(-num_tokens // self.block_size)
        if self._next_block + count > self.worker.kv_spec.num_blocks:
            self._next_block = 0  # KV contents do not matter here; reuse from the start
        start = self._next_block
        self._next_block += count
        return tuple(range(start, start + count))

    def _new_request(self, request_id: str, prompt_len: int, params: Any, room: int):
        from actors.protocol.messages import NewRequestData

        tokens = tuple(int(t) for t in self._rng.integers(0, self.vocab_size, prompt_len))
        return NewRequestData(request_id=request_id, token_ids=tokens, prompt_len=prompt_len,
                              block_ids=self._blocks(prompt_len + room), num_computed_tokens=0,
                              sampling_params=params)

    def _sched(self, new, ids, num_scheduled, num_computed, finished=frozenset()):
        from actors.protocol.messages import CachedRequestData, SchedulerOutput

        self._step_id += 1
        finished = frozenset(finished) | self._to_free
        self._to_free = set()
        return SchedulerOutput(step_id=self._step_id, new_requests=tuple(new),
                               cached_requests=CachedRequestData(),
                               scheduled_request_ids=tuple(ids),
                               num_scheduled_tokens=tuple(num_scheduled),
                               num_computed_tokens=tuple(num_computed),
                               samples_token=(True,) * len(ids),
                               finished_request_ids=finished)

    def start_batch(self, num_reqs: int, context: int, temperature: float = 1.0,
                    top_p: float = 1.0, room: int = 128) -> Batch:
        """Add and prefill num_reqs requests so that their next decode step runs at
        sequence length `context`."""
        from actors.protocol.sampling_params import SamplingParams

        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=4096,
                                ignore_eos=True)
        prompt_len = context - 1
        batch = Batch([f"r{self._step_id}-{i}" for i in range(num_reqs)], [0] * num_reqs, params,
                      self._blocks(4096))
        per_step = max(1, self.config.max_num_batched_tokens // prompt_len)
        for start in range(0, num_reqs, per_step):
            ids = batch.request_ids[start:start + per_step]
            new = [self._new_request(r, prompt_len, params, room) for r in ids]
            self.runner.execute(self._sched(new, ids, [prompt_len] * len(ids), [0] * len(ids))).result()
        batch.num_computed = [prompt_len] * num_reqs
        return batch

    def step(self, batch: Batch, prefill_tokens: int = 0):
        """Launch one decode step of the batch (plus a fresh prefill of prefill_tokens);
        returns the runner's PendingStep."""
        ids = list(batch.request_ids)
        scheduled, computed = [1] * len(ids), list(batch.num_computed)
        new = []
        finished = set(batch.pending_finished)
        batch.pending_finished.clear()
        if prefill_tokens:
            batch.prefill_seq += 1
            request_id = f"p{self._step_id}-{batch.prefill_seq}"
            new.append(self._prefill_request(request_id, prefill_tokens, batch))
            ids.append(request_id)
            scheduled.append(prefill_tokens)
            computed.append(0)
            batch.pending_finished.add(request_id)  # freed by the next step
        batch.num_computed = [n + 1 for n in batch.num_computed]
        return self.runner.execute(self._sched(new, ids, scheduled, computed, finished))

    def _prefill_request(self, request_id: str, prompt_len: int, batch: Batch):
        from actors.protocol.messages import NewRequestData

        tokens = tuple(int(t) for t in self._rng.integers(0, self.vocab_size, prompt_len))
        return NewRequestData(request_id=request_id, token_ids=tokens, prompt_len=prompt_len,
                              block_ids=batch.prefill_blocks[: -(-(prompt_len + 1) // self.block_size)],
                              num_computed_tokens=0, sampling_params=batch.params)

    def finish_batch(self, batch: Batch) -> None:
        """Free every row of the batch. A step must schedule something, so a 4-token
        keeper request carries the frees; the next step frees the keeper."""
        self._to_free |= set(batch.request_ids) | batch.pending_finished
        batch.pending_finished.clear()
        keeper = f"k{self._step_id}"
        new = [self._new_request(keeper, 4, batch.params, 8)]
        self.runner.execute(self._sched(new, [keeper], [4], [0])).result()
        self._to_free.add(keeper)

    # ---- timing -------------------------------------------------------------------------

    def steady_state(self, batch: Batch, num_steps: int, prefill_tokens: int = 0) -> dict[str, Any]:
        """num_steps decode steps with two in flight, as the GPU actor runs them: the period
        per step, and the means of the runner's own step stats."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        in_flight: deque = deque()
        outputs = []
        started = time.perf_counter()
        for _ in range(num_steps):
            in_flight.append(self.step(batch, prefill_tokens))
            if len(in_flight) > 1:
                outputs.append(in_flight.popleft().result())
        while in_flight:
            outputs.append(in_flight.popleft().result())
        elapsed = time.perf_counter() - started
        stats = [o.stats for o in outputs[1:]]
        errors = [o.error for o in outputs if getattr(o, "error", None)]
        if errors:
            raise RuntimeError(f"step failed: {errors[0]}")
        return {
            "num_reqs": len(batch.request_ids), "prefill_tokens": prefill_tokens,
            "period_ms": round(elapsed / num_steps * 1e3, 4),
            # Device time between the runner's first and last launch of a step (0 off CUDA).
            "device_ms": round(float(np.mean([s.step_time_s for s in stats])) * 1e3, 4),
            "device_ms_min": round(float(np.min([s.step_time_s for s in stats])) * 1e3, 4),
            "gpu_idle_ms": round(float(np.mean([s.gpu_idle_s for s in stats])) * 1e3, 4),
            "cpu_launch_ms": round(float(np.mean([s.prepare_time_s for s in stats])) * 1e3, 4),
            "output_tok_s": round(len(batch.request_ids) * num_steps / elapsed),
        }


def _engine_config_class() -> type:
    try:  # where the config lives since the engine core has its own process
        from actors.protocol.config import EngineConfig
    except ImportError:
        from app.config import EngineConfig
    return EngineConfig
