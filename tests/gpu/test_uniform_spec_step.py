"""Uniform speculative steps (gpu/spec_decode/uniform_graphs.py): a pure-decode speculative
step padded to K + 1 tokens per row gives the tokens the unpadded (mixed) step and plain
decoding give, greedy and seeded; a row without drafts advances exactly one token, and the
padding writes no KV; whatever K each step runs, the tokens are the same. On CPU the
graph's function runs eagerly on the padded buffers; the gpu-marked tests capture it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from actors.protocol.sampling_params import SamplingParams
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.models.llama import DecoderModel
from gpu.spec_decode.spec_runner import uniform_shape
from gpu.spec_decode.uniform_graphs import (
    clamp_padding_blocks,
    mask_padding_slots,
    uniform_graph_sizes,
)
from gpu.weights.dummy import dummy_weights
from tests.gpu.test_spec_graph_runner import BLOCK_SIZE, MAX_MODEL_LEN, TINY, _Engine

K = 3  # test_spec_graph_runner's SpeculativeConfig
PARAMS = {
    "g0": SamplingParams(temperature=0.0),
    "s1": SamplingParams(temperature=0.8, seed=3),
    "f2": SamplingParams(temperature=1.1, top_k=6, top_p=0.9, seed=4),
    "g3": SamplingParams(temperature=0.0),
    "s4": SamplingParams(temperature=1.0, seed=9),
}
BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK_SIZE


def _model(device: torch.device) -> DecoderModel:
    model = DecoderModel(TINY, TritonAttentionBackend(), torch.float32, device)
    model.load_weights(dummy_weights(TINY, torch.float32, device, seed=5))
    return model


def _prompts(seed: int) -> dict[str, tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, TINY.vocab_size, 4)  # repeated: the proposer finds n-grams
    return {
        name: tuple(int(t) for t in np.concatenate([phrase, rng.integers(0, 4, 3), phrase]))
        for name in PARAMS
    }


class _Driver:
    """Steps one engine like a scheduler that keeps every request decoding; each request's
    device history is the truth it follows."""

    def __init__(self, engine: _Engine, prompts: dict[str, tuple[int, ...]]) -> None:
        self.engine = engine
        self.prompts = prompts
        self.total: dict[str, int] = {}
        self.step_id = 0
        self.counts: list[list[int]] = []

    def prefill(self) -> None:
        names = list(self.prompts)
        new = tuple(
            NewRequestData(
                name,
                self.prompts[name],
                len(self.prompts[name]),
                tuple(range(i * BLOCKS_PER_REQ, (i + 1) * BLOCKS_PER_REQ)),
                0,
                PARAMS[name],
            )
            for i, name in enumerate(names)
        )
        self._run(
            SchedulerOutput(
                self.step_id,
                new,
                CachedRequestData(),
                tuple(names),
                tuple(len(self.prompts[n]) for n in names),
                (0,) * len(names),
                (True,) * len(names),
                frozenset(),
            )
        )

    def decode(self, slots: dict[str, int], names: list[str] | None = None) -> list[int]:
        """One decode step of `names` (default every request), slots[name] draft slots
        each; the counts."""
        names = list(self.prompts) if names is None else names
        num_slots = tuple(slots.get(n, 0) for n in names)
        return self._run(
            SchedulerOutput(
                self.step_id,
                (),
                CachedRequestData(),
                tuple(names),
                tuple(1 + s for s in num_slots),
                tuple(self.total[n] - 1 for n in names),
                (True,) * len(names),
                frozenset(),
                num_draft_slots=num_slots if any(num_slots) else (),
            )
        )

    def _run(self, sched: SchedulerOutput) -> list[int]:
        _, counts, _ = self.engine.step(sched)
        for name, count in zip(sched.scheduled_request_ids, counts):
            self.total[name] = self.total.get(name, len(self.prompts[name])) + count
        self.step_id += 1
        self.counts.append(counts)
        return counts

    def history(self, name: str, length: int) -> list[int]:
        row = self.engine.runner.states.row_of[name]
        return self.engine.runner.states.token_ids_gpu[row, :length].tolist()


def _generate(engine: _Engine, prompts: dict, num_tokens: int, slot_plan) -> dict[str, list[int]]:
    """Every request's prompt and first num_tokens outputs, stepping with slot_plan(step,
    driver) draft slots per request."""
    driver = _Driver(engine, prompts)
    driver.prefill()
    while unfinished := [n for n in prompts if driver.total[n] - len(prompts[n]) < num_tokens]:
        # a row done stops: one whose drafts keep being accepted would outrun the context
        driver.decode(slot_plan(driver.step_id, driver), unfinished)
    return {n: driver.history(n, len(prompts[n]) + num_tokens) for n in prompts}


def _check_the_draft_length_never_changes_tokens(device: str) -> None:
    device_ = torch.device(device)
    model = _model(device_)
    prompts = _prompts(2)
    num_tokens = 24
    plain = _generate(_Engine(model, device_, "eager"), prompts, num_tokens, lambda *_: {})
    rng = np.random.default_rng(0)

    def random_k(step: int, driver: _Driver) -> dict[str, int]:
        # A step's K from 0 to 3, each row 0..K slots (rows without any padded to K + 1).
        draft_len = int(rng.integers(0, K + 1))
        return {n: int(rng.integers(0, draft_len + 1)) for n in prompts}

    uniform = _Engine(model, device_, "uniform")
    assert _generate(uniform, prompts, num_tokens, random_k) == plain
    assert uniform.replays["uniform"] > 10
    full = _Engine(model, device_, "uniform")
    assert _generate(full, prompts, num_tokens, lambda *_: dict.fromkeys(prompts, K)) == plain
    # The same steps unpadded: each row runs its own slots in the mixed layout.
    mixed = _Engine(model, device_, "tails")
    assert _generate(mixed, prompts, num_tokens, lambda *_: dict.fromkeys(prompts, K)) == plain
    assert mixed.replays["uniform"] == 0 and mixed.replays["run"] > 0


def test_the_draft_length_never_changes_tokens() -> None:
    _check_the_draft_length_never_changes_tokens("cpu")


def _kv_slots_written(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    """Flat KV slots (block * block_size + offset) whose keys or values changed."""
    changed: set[int] = set()
    for old, new in zip(before, after):
        # [2, num_blocks, block_size, heads, dim] -> [num_blocks * block_size]
        differs = (old != new).flatten(3).any(-1).any(0).flatten()
        changed |= set(differs.nonzero().flatten().tolist())
    return changed


def _check_rows_without_drafts_advance_one_token(device: str) -> None:
    device_ = torch.device(device)
    engine = _Engine(_model(device_), device_, "uniform")
    prompts = _prompts(3)
    driver = _Driver(engine, prompts)
    driver.prefill()
    for _ in range(2):  # plain steps: every row's next position is 13, block 3 of 4-token blocks
        driver.decode({})
    states = engine.runner.states
    computed = {n: int(states.num_computed_gpu[states.row_of[n]]) for n in prompts}
    slots = {"g0": K, "s1": 0, "f2": 1, "g3": 0, "s4": 2}
    # Past each row's last real position the table holds ids of no block of this cache
    # (as stale rows of an engine with a larger cache would): padding must not read them.
    crossing = 0
    for name in prompts:
        row, last_real = states.row_of[name], computed[name] + slots[name]
        states.block_table_gpu[row, last_real // BLOCK_SIZE + 1 :] = 10**6
        crossing += (computed[name] + K) // BLOCK_SIZE > last_real // BLOCK_SIZE
    assert crossing >= 2  # some rows' padding reaches past their last real block
    kv_before = [cache.clone() for cache in engine.kv_caches]
    counts = dict(zip(prompts, driver.decode(slots)))
    assert engine.replays["uniform"] == 1
    for name in ("s1", "g3"):
        row = states.row_of[name]
        assert counts[name] == 1
        assert int(states.num_computed_gpu[row]) == computed[name] + 1
        assert int(states.total_len_gpu[row]) == computed[name] + 2
    for name, count in counts.items():
        assert 1 <= count <= 1 + slots[name]
        assert int(states.num_computed_gpu[states.row_of[name]]) == computed[name] + count
    # KV written only at each row's last token and slots: never at a padding token.
    allowed = set()
    for index, name in enumerate(prompts):
        for position in range(computed[name], computed[name] + 1 + slots[name]):
            block = index * BLOCKS_PER_REQ + position // BLOCK_SIZE
            allowed.add(block * BLOCK_SIZE + position % BLOCK_SIZE)
    written = _kv_slots_written(kv_before, engine.kv_caches)
    assert written <= allowed and len(written) >= len(prompts)


def test_rows_without_drafts_advance_one_token_and_padding_touches_no_other_kv() -> None:
    _check_rows_without_drafts_advance_one_token("cpu")


def test_padding_tokens_get_the_padding_slot() -> None:
    slot_mapping = torch.arange(12, dtype=torch.int64)  # 3 requests x (K + 1 = 4) tokens
    mask_padding_slots(slot_mapping, torch.tensor([2, 0, 3], dtype=torch.int32), 3)
    assert slot_mapping.tolist() == [0, 1, 2, -1, 4, -1, -1, -1, 8, 9, 10, 11]


def test_block_columns_past_the_last_real_position_point_at_its_block() -> None:
    table = torch.tensor([[7, 8, 99, 99], [3, 99, 99, 99], [0, 0, 0, 0]], dtype=torch.int32)
    # K = 3, blocks of 4: row 0 computed 5 (positions 5..8, 2 slots: last real 7, block 1),
    # row 1 computed 2 (positions 2..5, no slot: last real 2, block 0), row 2 padding.
    seq_lens = torch.tensor([9, 6, 0], dtype=torch.int32)
    slots = torch.tensor([2, 0, 0], dtype=torch.int32)
    clamp_padding_blocks(table, seq_lens, slots, 3, 4)
    assert table.tolist() == [[7, 8, 8, 8], [3, 3, 3, 3], [0, 0, 0, 0]]


def _sched(scheduled: tuple[int, ...], slots: tuple[int, ...], computed: int) -> SchedulerOutput:
    n = len(scheduled)
    return SchedulerOutput(
        1,
        (),
        CachedRequestData(),
        tuple(f"r{i}" for i in range(n)),
        scheduled,
        (computed,) * n,
        (True,) * n,
        frozenset(),
        num_draft_slots=slots,
    )


def test_only_pure_decode_steps_within_the_context_run_uniform() -> None:
    graphs = type("G", (), {"padded_size": lambda self, n, k: 4 if n <= 4 else None})()
    assert uniform_shape(_sched((3, 1, 2), (2, 0, 1), 10), graphs, 64) == (2, 4)
    assert uniform_shape(_sched((1, 1), (0, 0), 10), graphs, 64) is None  # no slots
    assert uniform_shape(_sched((3, 5), (2, 0), 10), graphs, 64) is None  # a prefill chunk
    # Positions 62..64 for K = 2: the last one past max_model_len 64; 61..63 fit.
    assert uniform_shape(_sched((3, 1), (2, 0), 62), graphs, 64) is None
    assert uniform_shape(_sched((3, 1), (2, 0), 61), graphs, 64) == (2, 4)
    assert uniform_shape(_sched((2,) * 5, (1,) * 5, 10), graphs, 64) is None  # no graph


def test_graph_sizes_stop_at_the_row_budget() -> None:
    sizes = uniform_graph_sizes((1, 2, 4, 8, 16, 32, 64, 96, 128, 256), 4, 512)
    assert sizes[1] == (1, 2, 4, 8, 16, 32, 64, 96, 128, 256)
    assert sizes[4] == (1, 2, 4, 8, 16, 32, 64, 96)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_uniform_steps_never_change_tokens_on_cuda() -> None:
    _check_the_draft_length_never_changes_tokens("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_uniform_steps_advance_rows_without_drafts_one_token_on_cuda() -> None:
    _check_rows_without_drafts_advance_one_token("cuda")
