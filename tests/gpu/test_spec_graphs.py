"""The speculative tail's fixed shape (gpu/spec_decode/spec_graphs.py) against the eager
tail over the variable logit layout (gpu/spec_decode/spec_step.py): the same logit rows
for every real row, padding rows never accepted, and, run eagerly on CPU (the function a
CUDA graph captures), the same emitted tokens, counts, row state and drafts."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors.protocol.sampling_params import SamplingParams
from actors.protocol.speculative_config import SpeculativeConfig
from gpu.input_buffers import InputBuffers
from gpu.runner_v2.states import RequestStates
from gpu.sampling.sampler import Sampler, batch_ops
from gpu.sampling.state import SamplingState
from gpu.spec_decode.device_drafts import DeviceDrafts
from gpu.spec_decode.spec_graphs import MAX_SPEC_GRAPH_LOGIT_ROWS, spec_graph_sizes
from gpu.spec_decode.spec_step import spec_layout, verify_and_update
from gpu.spec_decode.spec_tail import fixed_logits_indices, spec_tail

K = 3
VOCAB = 40
HIDDEN = 12
MAX_REQS = 8
MAX_TOKENS = 64
MAX_MODEL_LEN = 48
PARAMS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, seed=11),
    SamplingParams(temperature=1.3, seed=12),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=13),
    SamplingParams(temperature=1.0, seed=14),
)
FILTERED = SamplingParams(temperature=1.1, top_k=8, top_p=0.9, min_p=0.05, seed=15)


def _plan(query_lens: list[int], rows: list[int], num_reqs_padded: int) -> SimpleNamespace:
    num_tokens = int(sum(query_lens))
    query_start_loc = np.full(num_reqs_padded + 1, num_tokens, dtype=np.int32)
    query_start_loc[: len(query_lens) + 1] = np.concatenate([[0], np.cumsum(query_lens)])
    return SimpleNamespace(
        num_reqs=len(query_lens),
        num_tokens=num_tokens,
        query_start_loc_np=query_start_loc,
        idx_mapping_np=np.asarray(rows, dtype=np.int32),
    )


def test_sizes_stop_at_the_logit_row_budget() -> None:
    sizes = spec_graph_sizes((1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 256), 4)
    assert sizes == (1, 2, 4, 8, 16, 32, 64, 96)
    assert all(n * 5 <= MAX_SPEC_GRAPH_LOGIT_ROWS for n in sizes)


@pytest.mark.parametrize("seed", range(4))
def test_fixed_rows_are_the_variable_layout_rows_then_repeats(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(1, 7))
    slots = rng.integers(0, K + 1, num_reqs)
    slots[rng.random(num_reqs) < 0.3] = 0  # rows that do not speculate (or prefill chunks)
    query_lens = [int(s) + 1 if s or rng.random() < 0.5 else int(rng.integers(2, 6)) for s in slots]
    plan = _plan(query_lens, list(range(num_reqs)), 8)
    variable = spec_layout(plan, tuple(int(s) for s in slots), torch.device("cpu"))
    fixed = fixed_logits_indices(
        torch.from_numpy(plan.query_start_loc_np),
        torch.from_numpy(np.pad(slots, (0, 8 - num_reqs))).to(torch.int32),
        K,
    )
    assert fixed.shape == (8, K + 1)
    cu = variable.cu_num_logits_np
    for b in range(num_reqs):
        real = variable.logits_indices_gpu[cu[b] : cu[b + 1]].tolist()
        assert fixed[b, : slots[b] + 1].tolist() == real
        assert fixed[b, slots[b] + 1 :].tolist() == [real[-1]] * (K - slots[b])
    assert fixed[num_reqs:].tolist() == [[plan.num_tokens - 1] * (K + 1)] * (8 - num_reqs)


class _Step:
    """One speculative step's inputs: row state, sampling state, drafts, buffers, hidden
    states and a linear head, for num_reqs requests padded to MAX_REQS."""

    def __init__(self, rng: np.random.Generator, num_reqs: int, filtered: bool) -> None:
        device = torch.device("cpu")
        self.rows = rng.permutation(MAX_REQS)[:num_reqs].astype(np.int32)
        self.states = RequestStates(MAX_REQS, MAX_MODEL_LEN, 4, device)
        self.sampling = SamplingState(MAX_REQS, VOCAB, device)
        self.drafts = DeviceDrafts(SpeculativeConfig("ngram", K, 1, 2), MAX_REQS, device)
        # Rows outside the step hold histories and drafts the proposer would not write:
        # a write that reached them would show.
        self.states.token_ids_gpu[:] = torch.from_numpy(
            rng.integers(0, 6, (MAX_REQS, MAX_MODEL_LEN))
        )
        self.states.total_len_gpu[:] = 20
        self.states.num_computed_gpu[:] = 19
        self.drafts.draft_token_ids_gpu[:] = VOCAB - 1
        self.drafts.num_drafts_gpu[:] = K
        self.slots = rng.integers(0, K + 1, num_reqs).astype(np.int32)
        self.slots[0] = 0  # a prefill chunk: no slots, four tokens, no sample
        query_lens = [4] + [int(s) + 1 for s in self.slots[1:]]
        positions = []
        for b, row in enumerate(self.rows):
            total = int(rng.integers(8, 30))
            # A short vocabulary of repeats, so that the proposer finds matches.
            history = rng.integers(0, 6, total)
            self.states.token_ids_gpu[row, :total] = torch.from_numpy(history).to(torch.int32)
            self.states.total_len_gpu[row] = total
            self.states.prompt_len_gpu[row] = 5
            computed = total - 10 if b == 0 else total - 1
            self.states.num_computed_gpu[row] = computed
            positions += range(computed, computed + query_lens[b])
            params = FILTERED if filtered and b == 2 else PARAMS[b % len(PARAMS)]
            self.sampling.add_request(int(row), params, history[:5].tolist(), [], [], 100 + b)
            num_drafts = int(rng.integers(0, K + 1))
            self.drafts.num_drafts_gpu[row] = num_drafts
            self.drafts.draft_token_ids_gpu[row] = torch.tensor(
                [int(t) if j < num_drafts else -1 for j, t in enumerate(rng.integers(0, VOCAB, K))],
                dtype=torch.int32,
            )
        self.sampling.flush_to_device()
        self.plan = _plan(query_lens, self.rows.tolist(), MAX_REQS)
        self.buffers = InputBuffers(MAX_REQS, MAX_TOKENS, 4, device)
        self.buffers.upload_step_meta(self.plan.idx_mapping_np, self.plan.query_start_loc_np)
        self.buffers.positions[: len(positions)] = torch.tensor(positions)
        self.hidden = torch.zeros(MAX_TOKENS, HIDDEN)
        self.hidden[: len(positions)] = torch.from_numpy(
            rng.standard_normal((len(positions), HIDDEN))
        ).float()
        weight = torch.from_numpy(rng.standard_normal((HIDDEN, VOCAB))).float() * 3
        self.model = SimpleNamespace(compute_logits=lambda hidden, out=None: hidden @ weight)

    def run_eager(self) -> tuple[SimpleNamespace, torch.Tensor]:
        """The current eager tail on a copy; the copy's state and the sampler's tokens at
        every variable logit row."""
        state = copy.deepcopy(
            SimpleNamespace(states=self.states, sampling=self.sampling, drafts=self.drafts)
        )
        layout = spec_layout(self.plan, tuple(self.slots.tolist()), torch.device("cpu"))
        num_reqs = self.plan.num_reqs
        idx_mapping = self.buffers.idx_mapping[:num_reqs]
        sampled = verify_and_update(
            self.model.compute_logits(self.hidden[layout.logits_indices_gpu]),
            layout,
            idx_mapping,
            self.buffers.query_start_loc[: num_reqs + 1],
            self.buffers.positions,
            state.states,
            Sampler(state.sampling),
            state.drafts,
            batch_ops(state.sampling, layout.logit_rows_np),
            None,
        )
        state.drafts.propose(state.states, idx_mapping)
        state.result = (sampled.output_token_ids, sampled.num_accepted, sampled.num_draft_tokens)
        return state, sampled.sampler.sampled_token_ids

    def run_fixed(self, filters: bool, num_reqs_padded: int = MAX_REQS) -> SimpleNamespace:
        state = copy.deepcopy(
            SimpleNamespace(states=self.states, sampling=self.sampling, drafts=self.drafts)
        )
        slots = torch.zeros(num_reqs_padded, dtype=torch.int32)
        slots[: self.plan.num_reqs] = torch.from_numpy(self.slots)
        packed = spec_tail(
            self.model,
            self.hidden,
            self.buffers,
            slots,
            state.states,
            Sampler(state.sampling),
            state.drafts,
            filters,
        )
        num_reqs = self.plan.num_reqs
        state.result = (
            packed[:num_reqs, : K + 1],
            packed[:num_reqs, K + 1].to(torch.int32),
            packed[:num_reqs, K + 2].to(torch.int32),
        )
        return state

    def accept_some(self, rng: np.random.Generator, sampled: torch.Tensor) -> np.ndarray:
        """Rewrite the drafts so that request b accepts a chosen count of them: its first
        ones equal the sampler's tokens, the next one differs."""
        cu = np.concatenate([[0], np.cumsum(self.slots + 1)])
        targets = np.zeros(len(self.rows), dtype=np.int64)
        for b, row in enumerate(self.rows):
            target = int(rng.integers(0, self.slots[b] + 1))
            drafts = [int(sampled[cu[b] + j]) for j in range(target)]
            if target < self.slots[b]:
                drafts.append((int(sampled[cu[b] + target]) + 1) % VOCAB)
            drafts += [-1] * (K - len(drafts))
            self.drafts.draft_token_ids_gpu[row] = torch.tensor(drafts, dtype=torch.int32)
            self.drafts.num_drafts_gpu[row] = sum(d >= 0 for d in drafts)
            targets[b] = target
        return targets


@pytest.mark.parametrize(
    "seed,num_reqs,filtered",
    [(0, 5, False), (1, 3, True), (2, 6, False), (3, 8, True), (4, 1, False)],
)
def test_fixed_tail_emits_what_the_eager_tail_emits(
    seed: int, num_reqs: int, filtered: bool
) -> None:
    rng = np.random.default_rng(seed)
    step = _Step(rng, num_reqs, filtered)
    _, sampled = step.run_eager()
    accepted = step.accept_some(rng, sampled)
    eager, _ = step.run_eager()
    # One request runs unpadded, as in the graph of size 1.
    fixed = step.run_fixed(filters=filtered, num_reqs_padded=MAX_REQS if num_reqs > 1 else 1)
    assert eager.result[1].tolist() == accepted[:num_reqs].tolist()  # the drafts did their job
    for got, want in zip(fixed.result, eager.result):
        assert got.tolist() == want.tolist()
    for name in ("token_ids_gpu", "num_computed_gpu", "total_len_gpu", "last_sampled_gpu"):
        assert torch.equal(getattr(fixed.states, name), getattr(eager.states, name)), name
    for name in ("draft_token_ids_gpu", "num_drafts_gpu"):
        assert torch.equal(getattr(fixed.drafts, name), getattr(eager.drafts, name)), name


def test_padding_requests_and_unused_rows_are_never_accepted() -> None:
    """Drafts that would match the tokens sampled at the rows past a request's slots, and
    at padding requests, are not accepted: only the slots' own drafts count."""
    rng = np.random.default_rng(7)
    step = _Step(rng, 3, filtered=False)
    step.slots[:] = [0, 1, 0]
    step.plan = _plan([4, 2, 1], step.rows.tolist(), MAX_REQS)
    step.buffers.upload_step_meta(step.plan.idx_mapping_np, step.plan.query_start_loc_np)
    everything = step.run_fixed(filters=False)
    # Re-run with every draft equal to a token the tail would sample at some logit row.
    for row in range(MAX_REQS):
        step.drafts.draft_token_ids_gpu[row] = everything.result[0][0, 0].to(torch.int32)
        step.drafts.num_drafts_gpu[row] = K
    fixed = step.run_fixed(filters=False)
    num_accepted = fixed.result[1].tolist()
    assert num_accepted[0] == 0 and num_accepted[2] == 0 and num_accepted[1] <= 1
    rows = step.rows.tolist()
    for row in range(MAX_REQS):  # no row outside the step moved
        if row not in rows:
            assert int(fixed.states.total_len_gpu[row]) == int(step.states.total_len_gpu[row])
            assert int(fixed.states.num_computed_gpu[row]) == int(step.states.num_computed_gpu[row])
