"""A fake V2 device for speculative scheduling: it keeps its own computed counts (the truth
the scheduler only bounds), runs draft slots with random drafts, accepts a random prefix,
and checks that every KV position a step attends to holds the token the history has
there, so a wrong rollback of rejected slots shows up as stale KV.

With max_model_len set it pads pure-decode speculative steps as the V2 runner does
(gpu/spec_decode/uniform_graphs.py): every row runs K + 1 tokens, the padding writing to
a scratch slot and never into a block, so the scheduler reserves nothing for it; a row
whose padding would pass max_model_len keeps the step unpadded."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.scheduler import Scheduler, StepResult
from actors.protocol.messages import SchedulerOutput, StepOutput, StepStats
from tests.actors._kv_helpers import EOS_TOKEN_ID


@dataclass(slots=True)
class _DeviceRow:
    history: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SpecFakeRunner:
    block_size: int
    manager: KVCacheManager
    rng: random.Random
    eos_probability: float = 0.0
    vocab_size: int = 50
    rows: dict[str, _DeviceRow] = field(default_factory=dict)
    kv_cache: dict[int, list[int | None]] = field(default_factory=dict)
    pending_updates: list[StepOutput] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    max_tokens: dict[str, int] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    num_drafts: int = 0
    num_accepted: int = 0
    max_model_len: int | None = None
    """Pad pure-decode speculative steps (see the module doc); None: never."""
    accept_probability: float | None = None
    """Chance that each next draft is accepted; None: a uniformly random prefix."""
    num_uniform_steps: int = 0
    num_padding_tokens: int = 0

    def register(self, request_id: str, max_tokens: int) -> None:
        self.max_tokens[request_id] = max_tokens
        self.outputs[request_id] = []

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.finished.setdefault(request_id, "abort")

    def execute(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids:
            del self.rows[request_id]
        for new in out.new_requests:
            assert new.request_id not in self.rows
            assert list(new.token_ids[new.prompt_len :]) == self.outputs[new.request_id]
            self.rows[new.request_id] = _DeviceRow(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for request_id, block_ids in zip(
            out.cached_requests.request_ids, out.cached_requests.new_block_ids
        ):
            self.rows[request_id].block_ids.extend(block_ids)
        slots = out.num_draft_slots or (0,) * out.num_reqs
        draft_len = self._uniform_draft_len(out, slots)
        emitted: list[tuple[str, list[int], int]] = []
        for request_id, num_new, num_computed, samples, num_slots in zip(
            out.scheduled_request_ids,
            out.num_scheduled_tokens,
            out.num_computed_tokens,
            out.samples_token,
            slots,
        ):
            row = self.rows[request_id]
            assert num_computed >= row.num_computed_tokens, (
                "the scheduler's bound is below the truth"
            )
            start = row.num_computed_tokens
            tokens = self._run(request_id, row, num_new, num_slots)
            if draft_len:
                self._pad(start, num_slots, draft_len)
            if samples:
                emitted.append((request_id, tokens, num_slots))
            else:
                assert row.num_computed_tokens < len(row.history)
        self.pending_updates.append(
            StepOutput(
                step_id=out.step_id,
                request_ids=tuple(rid for rid, _, _ in emitted),
                sampled_token_ids=np.asarray(
                    [t for _, tokens, _ in emitted for t in tokens], np.int64
                ),
                logprobs=None,
                stats=StepStats(out.step_id, out.num_reqs, out.total_num_scheduled_tokens, 0),
                num_sampled_tokens=np.asarray([len(tokens) for _, tokens, _ in emitted], np.int32),
                num_draft_tokens=np.asarray([s for _, _, s in emitted], np.int32),
            )
        )

    def _uniform_draft_len(self, out: SchedulerOutput, slots: tuple[int, ...]) -> int:
        """K when the V2 runner would pad `out` to K + 1 tokens per row, else 0."""
        draft_len = max(slots, default=0)
        if self.max_model_len is None or draft_len == 0 or not all(out.samples_token):
            return 0
        if any(n != 1 + s for n, s in zip(out.num_scheduled_tokens, slots)):
            return 0
        if max(out.num_computed_tokens) + draft_len + 1 > self.max_model_len:
            return 0
        self.num_uniform_steps += 1
        return draft_len

    def _pad(self, start: int, num_slots: int, draft_len: int) -> None:
        """The padding tokens of a row that ran from `start` with num_slots of K slots:
        positions start + 1 + num_slots .. start + K, every one below max_model_len (the
        token history and the block table end there), writing to the scratch slot: no
        block, no history, no computed token."""
        assert self.max_model_len is not None
        assert start + draft_len < self.max_model_len, "padding past max_model_len"
        self.num_padding_tokens += draft_len - num_slots

    def _run(self, request_id: str, row: _DeviceRow, num_new: int, num_slots: int) -> list[int]:
        """Run one row's tokens (drafts in its slots); returns the tokens it emits."""
        start = row.num_computed_tokens
        assert len(row.block_ids) * self.block_size >= start + num_new, (
            f"{request_id}: blocks do not cover position {start + num_new - 1}"
        )
        assert tuple(row.block_ids) == self.manager.block_ids(request_id)
        if num_slots:
            assert num_new == 1 + num_slots and start == len(row.history) - 1, (
                f"{request_id}: draft slots on a row that is not decoding"
            )
        drafts = [self._token() for _ in range(num_slots)]
        inputs = row.history[start : start + num_new - num_slots] + drafts
        for position, token in enumerate(inputs, start):
            block = self.kv_cache.setdefault(
                row.block_ids[position // self.block_size], [None] * self.block_size
            )
            block[position % self.block_size] = token
        last = start + num_new - num_slots
        for position in range(last):  # what the known tokens attend to
            stored = self.kv_cache[row.block_ids[position // self.block_size]][
                position % self.block_size
            ]
            assert stored == row.history[position], f"{request_id}: stale KV at {position}"
        if last < len(row.history):
            row.num_computed_tokens = last
            return []
        num_accepted = self.rng.randint(0, num_slots)
        if self.accept_probability is not None:
            num_accepted = 0
            while num_accepted < num_slots and self.rng.random() < self.accept_probability:
                num_accepted += 1
        tokens = drafts[:num_accepted] + [self._token()]
        row.history.extend(tokens)
        row.num_computed_tokens = start + num_new - num_slots + num_accepted
        self.num_drafts += num_slots
        self.num_accepted += num_accepted
        return tokens

    def _token(self) -> int:
        if self.rng.random() < self.eos_probability:
            return EOS_TOKEN_ID
        return self.rng.randrange(self.vocab_size)

    def deliver_oldest(self, scheduler: Scheduler) -> StepResult:
        result = scheduler.update_from_step(self.pending_updates.pop(0))
        for request, count in zip(result.requests, result.num_tokens):
            assert request.request_id not in self.finished
            self.outputs[request.request_id].extend(request.output_token_ids[-count:])
            assert len(self.outputs[request.request_id]) <= self.max_tokens[request.request_id]
        for request, finish in result.finished:
            self.finished[request.request_id] = finish.reason
            if finish.reason == "stop":
                assert request.output_token_ids[-1] == EOS_TOKEN_ID
            # The device keeps what it emitted past a stop; a resumed request would not.
        for request_id, row in self.rows.items():
            request = scheduler.get_request(request_id)
            if request is not None and not scheduler.num_steps_in_flight:
                assert row.history == list(request.all_token_ids)
        return result
