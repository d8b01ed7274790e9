"""Helpers for KV cache and scheduler tests: a fake runner and workload checks.

`FakeRunner` plays the GPU actor: it executes each SchedulerOutput
as soon as it is scheduled (like the device, in submission order), keeps per-row token
histories and block tables, writes each computed token into a simulated KV cache and
checks that every token a step attends to is present in the blocks the request holds. The
step's result is returned later, so up to `max_steps_in_flight` steps overlap.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.scheduler import Scheduler, StepResult
from actors.protocol.messages import EngineRequest, SchedulerOutput, StepOutput, StepStats
from actors.protocol.sampling_params import SamplingParams

EOS_TOKEN_ID = 999
"""The fake model's end-of-sequence token (outside its ordinary vocabulary)."""


def assert_workload_drained(
    scheduler: Scheduler,
    manager: KVCacheManager,
    num_blocks: int,
    num_requests: int,
    finished: dict[str, str],
    aborted: set[str],
    num_outputs: dict[str, int],
    max_tokens: dict[str, int],
) -> None:
    """After a fake-device workload: every block back, nothing running or waiting, every
    request r0.. finished once (the aborted ones as 'abort'), and each 'length' finish
    after exactly its max_tokens outputs."""
    assert scheduler.schedule() is None  # releases the last finished requests' blocks
    manager.check_invariants()
    usage = manager.stats()
    assert usage.num_used_blocks == 0 and usage.num_free_blocks == num_blocks
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert set(finished) == {f"r{index}" for index in range(num_requests)}
    assert {rid for rid, reason in finished.items() if reason == "abort"} == aborted
    for request_id, reason in finished.items():
        if reason == "length":
            assert num_outputs[request_id] == max_tokens[request_id]


def engine_request(
    request_id: str,
    prompt: Iterable[int],
    max_tokens: int | None = 8,
    arrival_time: float = 0.0,
    priority: int = 0,
    cache_salt: str | None = None,
) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        eos_token_ids=(EOS_TOKEN_ID,),
    )


@dataclass(slots=True)
class _Row:
    history: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeRunner:
    """The GPU actor as a synchronous fake; see the module docstring. It samples
    EOS_TOKEN_ID with `eos_probability`, and records what the scheduler makes of each
    step (outputs kept, finish reasons)."""

    block_size: int
    max_num_seqs: int
    manager: KVCacheManager | None = None
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    eos_probability: float = 0.0
    vocab_size: int = 50
    rows: dict[str, _Row] = field(default_factory=dict)
    kv_cache: dict[int, list[int | None]] = field(default_factory=dict)
    pending_updates: list[StepOutput] = field(default_factory=list)
    max_tokens: dict[str, int] = field(default_factory=dict)
    num_outputs: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)

    def register(self, request_id: str, max_tokens: int) -> None:
        self.max_tokens[request_id] = max_tokens
        self.num_outputs[request_id] = 0
        self.outputs[request_id] = []
        self.finished.pop(request_id, None)

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.finished.setdefault(request_id, "abort")

    def execute(self, out: SchedulerOutput) -> None:
        """Run a step now; its StepOutput is queued for `deliver_oldest`."""
        for request_id in out.finished_request_ids:
            assert request_id in self.rows, f"step {out.step_id} frees {request_id}'s missing row"
            del self.rows[request_id]
        for new in out.new_requests:
            assert new.request_id not in self.rows, f"{new.request_id} takes a second row"
            in_flight = any(new.request_id in out.request_ids for out in self.pending_updates)
            assert not in_flight, f"{new.request_id} is admitted while a token is in flight"
            if new.request_id in self.outputs:
                assert list(new.token_ids[new.prompt_len :]) == self.outputs[new.request_id], (
                    f"{new.request_id} resumes with outputs other than those it produced"
                )
            self.rows[new.request_id] = _Row(
                list(new.token_ids), new.prompt_len, list(new.block_ids), new.num_computed_tokens
            )
        assert len(self.rows) <= self.max_num_seqs, "more rows than max_num_seqs"
        for request_id, new_block_ids in zip(
            out.cached_requests.request_ids, out.cached_requests.new_block_ids
        ):
            self.rows[request_id].block_ids.extend(new_block_ids)
        sampled: list[tuple[str, int]] = []
        batch = list(
            zip(
                out.scheduled_request_ids,
                out.num_scheduled_tokens,
                out.num_computed_tokens,
                out.samples_token,
            )
        )
        for request_id, num_new, num_computed, _ in batch:
            self._write_kv(out.step_id, request_id, num_new, num_computed)
        for request_id, num_new, num_computed, samples in batch:
            row = self.rows[request_id]
            self._check_attended_kv(request_id, row, num_computed + num_new)
            row.num_computed_tokens += num_new
            assert samples == (row.num_computed_tokens == len(row.history)), (
                f"{request_id}: samples_token {samples} but computed {row.num_computed_tokens} "
                f"of {len(row.history)} known tokens"
            )
            if samples:
                token_id = (
                    EOS_TOKEN_ID
                    if self.rng.random() < self.eos_probability
                    else self.rng.randrange(self.vocab_size)
                )
                row.history.append(token_id)
                sampled.append((request_id, token_id))
        self.pending_updates.append(
            StepOutput(
                step_id=out.step_id,
                request_ids=tuple(rid for rid, _ in sampled),
                sampled_token_ids=np.asarray([token_id for _, token_id in sampled], dtype=np.int64),
                logprobs=None,
                stats=StepStats(out.step_id, out.num_reqs, out.total_num_scheduled_tokens, 0),
            )
        )

    def deliver_oldest(self, scheduler: Scheduler) -> StepResult:
        """Hand the oldest step's result to the scheduler and record what it kept."""
        result = scheduler.update_from_step(self.pending_updates.pop(0))
        self._record(result)
        return result

    def _write_kv(self, step_id: int, request_id: str, num_new: int, num_computed: int) -> None:
        row = self.rows[request_id]
        assert num_computed == row.num_computed_tokens, (
            f"step {step_id}: scheduler says {request_id} computed {num_computed}, "
            f"runner has {row.num_computed_tokens}"
        )
        assert num_new > 0 and num_computed + num_new <= len(row.history), (
            f"step {step_id}: {request_id} runs {num_new} tokens from {num_computed} but only "
            f"{len(row.history)} are known"
        )
        assert len(row.block_ids) * self.block_size >= num_computed + num_new, (
            f"{request_id}: {len(row.block_ids)} blocks cannot hold {num_computed + num_new} tokens"
        )
        if self.manager is not None:
            assert tuple(row.block_ids) == self.manager.block_ids(request_id), (
                f"{request_id}: runner block table {row.block_ids} differs from the KV manager's"
            )
        for position in range(num_computed, num_computed + num_new):
            block = self.kv_cache.setdefault(
                row.block_ids[position // self.block_size], [None] * self.block_size
            )
            block[position % self.block_size] = row.history[position]

    def _check_attended_kv(self, request_id: str, row: _Row, num_tokens: int) -> None:
        for position in range(num_tokens):
            block = self.kv_cache.get(row.block_ids[position // self.block_size])
            stored = None if block is None else block[position % self.block_size]
            assert stored == row.history[position], (
                f"{request_id}: KV at position {position} holds {stored}, "
                f"expected token {row.history[position]}"
            )

    def _record(self, result: StepResult) -> None:
        for request in result.requests:
            request_id = request.request_id
            assert request_id not in self.finished, f"{request_id} got a token after finishing"
            self.num_outputs[request_id] += 1
            self.outputs[request_id].append(request.output_token_ids[-1])
            assert self.num_outputs[request_id] <= self.max_tokens[request_id], (
                f"{request_id} produced more than max_tokens={self.max_tokens[request_id]}"
            )
        for request, finish in result.finished:
            self.finished[request.request_id] = finish.reason
            if finish.reason == "stop":
                assert request.output_token_ids[-1] == EOS_TOKEN_ID
