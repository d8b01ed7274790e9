"""A V2 runner whose speculative steps replay the tail graphs (gpu/spec_decode/spec_graphs.py)
emits, step by step, what a runner launching the tail eagerly emits, and ends in the same
row state: greedy, seeded and filtered rows, slots without drafts, padded batches, and a
logprobs request whose steps take the eager tail in between. So does a runner whose
pure-decode speculative steps replay whole as uniform steps
(gpu/spec_decode/uniform_graphs.py). On CPU the graphs' functions run eagerly on the same
padded buffers; the gpu-marked test captures real graphs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from actors.protocol.config import EngineConfig
from actors.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.speculative_config import SpeculativeConfig
from gpu.attention.base import allocate_kv_cache
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.cuda_graphs import StepGraphs
from gpu.input_buffers import InputBuffers
from gpu.models.llama import DecoderModel
from gpu.runner_v2.runner import ModelRunnerV2
from gpu.runner_v2.step_plan import GraphSizes
from gpu.runner_v2.step_state import V2StepState
from gpu.weights.dummy import dummy_weights
from tests.gpu import test_cuda_graphs as graph_tests

# The step-graph tests' tiny model with a vocabulary small enough that drafts get accepted.
TINY = dataclasses.replace(graph_tests.TINY, vocab_size=24)
BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
MAX_REQS = 8
MAX_TOKENS = 64
NUM_BLOCKS = 8 * MAX_MODEL_LEN // BLOCK_SIZE
SIZES = GraphSizes(decode=(1, 2, 4, 8), mixed=(16, 32, 64), max_num_reqs=MAX_REQS)
SPEC = SpeculativeConfig("ngram", 3, 1, 2)
PARAMS = {
    "g0": SamplingParams(temperature=0.0),
    "s1": SamplingParams(temperature=0.8, seed=3),
    "f2": SamplingParams(temperature=1.1, top_k=6, top_p=0.9, seed=4),
    "g3": SamplingParams(temperature=0.0),
    "l4": SamplingParams(temperature=0.0, logprobs=2),
}


class _Engine:
    def __init__(self, model: DecoderModel, device: torch.device, mode: str) -> None:
        """mode: 'uniform' (every speculative graph), 'tails' (the tail graphs only) or
        'eager' (no speculative graph)."""
        tail_graphs = mode != "eager"
        self.kv_caches = allocate_kv_cache(
            TINY.num_layers,
            NUM_BLOCKS,
            BLOCK_SIZE,
            TINY.num_kv_heads,
            TINY.head_dim,
            torch.float32,
            device,
        )
        buffers = InputBuffers(MAX_REQS, MAX_TOKENS, MAX_MODEL_LEN // BLOCK_SIZE, device)
        state = V2StepState(
            buffers,
            MAX_MODEL_LEN,
            MAX_MODEL_LEN // BLOCK_SIZE,
            TINY.vocab_size,
            TINY.hidden_size,
            torch.float32,
            with_graph_outputs=True,
        )
        graphs = StepGraphs(model, self.kv_caches, state, SIZES, BLOCK_SIZE, MAX_MODEL_LEN)
        graphs.capture()
        config = EngineConfig(
            model="dummy:tiny",
            device=str(device),
            block_size=BLOCK_SIZE,
            max_num_seqs=MAX_REQS,
            max_num_batched_tokens=MAX_TOKENS,
            speculative_config=SPEC,
            spec_tail_graphs=tail_graphs,
        )
        worker = SimpleNamespace(
            config=config,
            device=device,
            buffers=buffers,
            step_state=state,
            graphs=graphs,
            model=model,
            kv_caches=self.kv_caches,
            max_model_len=MAX_MODEL_LEN,
            max_blocks_per_req=MAX_MODEL_LEN // BLOCK_SIZE,
            model_config=TINY,
            dtype=torch.float32,
        )
        self.runner = ModelRunnerV2(worker, config)  # type: ignore[arg-type]
        assert (self.runner.spec_graphs is not None) == tail_graphs
        self.runner.drafts.trims_on_cpu = False  # slots without drafts, as on a GPU
        self.replays = {"run": 0, "propose": 0, "uniform": 0}
        if tail_graphs:
            for name in ("run", "propose"):
                self._count(self.runner.spec_graphs, name)
            uniform = self.runner.spec_graphs.uniform
            if mode == "tails":
                self.runner.spec_graphs.uniform = None
            else:
                self._count(uniform, "run", "uniform")

    def _count(self, graphs: object, name: str, counter: str | None = None) -> None:
        replay = getattr(graphs, name)

        def counted(*args: object) -> torch.Tensor | None:
            self.replays[counter or name] += 1
            return replay(*args)

        setattr(graphs, name, counted)

    def step(self, sched: SchedulerOutput) -> tuple[list[int], list[int], list[int]]:
        out = self.runner.execute(sched).result()
        assert out.error is None
        num_sampled = (
            [1] * len(out.request_ids)
            if out.num_sampled_tokens is None
            else out.num_sampled_tokens.tolist()
        )
        num_drafts = [] if out.num_draft_tokens is None else out.num_draft_tokens.tolist()
        return out.sampled_token_ids.tolist(), num_sampled, num_drafts


def _prompts(rng: np.random.Generator) -> dict[str, tuple[int, ...]]:
    # Repeated phrases: the proposer finds n-grams to draft from.
    phrase = rng.integers(0, TINY.vocab_size, 5)
    return {
        name: tuple(int(t) for t in np.concatenate([phrase, rng.integers(0, 4, 3), phrase]))
        for name in PARAMS
    }


def _run_script(engines: list[_Engine], prompts: dict[str, tuple[int, ...]]) -> list[tuple]:
    """Prefill r0..r3, then speculative steps of K slots per row (step 10 plain), l4
    (logprobs) joining for a few steps and leaving; every engine runs each step, which the
    first one's emitted counts plan (they must agree anyway)."""
    blocks = iter(range(NUM_BLOCKS))
    total = {}
    results = []

    def new(name: str) -> NewRequestData:
        return NewRequestData(
            name,
            prompts[name],
            len(prompts[name]),
            tuple(next(blocks) for _ in range(MAX_MODEL_LEN // BLOCK_SIZE)),
            0,
            PARAMS[name],
        )

    def run(sched: SchedulerOutput) -> None:
        outs = [engine.step(sched) for engine in engines]
        assert all(out == outs[0] for out in outs[1:]), (sched.step_id, outs)
        for name, count in zip(sched.scheduled_request_ids, outs[0][1]):
            total[name] = total.get(name, len(prompts[name])) + count
        results.append(outs[0])

    first = ["g0", "s1", "f2", "g3"]
    run(
        SchedulerOutput(
            0,
            tuple(new(n) for n in first),
            CachedRequestData(),
            tuple(first),
            tuple(len(prompts[n]) for n in first),
            (0,) * 4,
            (True,) * 4,
            frozenset(),
        )
    )
    for step_id in range(1, 13):
        names = [n for n in PARAMS if n in total] if step_id < 8 else first
        if step_id == 3:
            names = first + ["l4"]
        speculates = step_id != 10  # a plain step: step 11 proposes before its forward
        num_slots = tuple(
            SPEC.num_speculative_tokens if n in total and speculates else 0 for n in names
        )
        computed = tuple(total[n] - 1 if n in total else 0 for n in names)
        scheduled = tuple(
            s + 1 if n in total else len(prompts[n]) for n, s in zip(names, num_slots)
        )
        run(
            SchedulerOutput(
                step_id,
                tuple(new(n) for n in names if n not in total),
                CachedRequestData(),
                tuple(names),
                scheduled,
                computed,
                (True,) * len(names),
                frozenset(["l4"]) if step_id == 8 else frozenset(),
                num_draft_slots=num_slots,
            )
        )
        if step_id == 8:
            total.pop("l4")
    return results


def _check_tail_graphs_match_the_eager_tail(device: str) -> None:
    device_ = torch.device(device)
    model = DecoderModel(TINY, TritonAttentionBackend(), torch.float32, device_)
    model.load_weights(dummy_weights(TINY, torch.float32, device_, seed=5))
    uniform = _Engine(model, device_, "uniform")
    graphed, eager = _Engine(model, device_, "tails"), _Engine(model, device_, "eager")
    results = _run_script([graphed, eager, uniform], _prompts(np.random.default_rng(1)))
    # Steps 3..7 hold the logprobs request and take the eager tail, step 10 is plain; the
    # 6 others replay a tail. Steps 1 and 11 follow plain steps: they replay a proposal.
    assert graphed.replays == {"run": 6, "propose": 2, "uniform": 0}
    # Those 6 are pure decode: each replays one uniform step instead (its drafts proposed
    # inside). Step 3 follows uniform steps: its proposal is replayed.
    assert uniform.replays == {"run": 0, "propose": 1, "uniform": 6}
    num_drafts = sum(sum(r[2]) for r in results)
    num_accepted = sum(sum(r[1]) - len(r[1]) for r in results[1:])
    assert num_drafts > 0 and num_accepted > 0  # both paths verified and accepted drafts
    for engine in (graphed, uniform):
        for name in ("num_computed_gpu", "total_len_gpu", "last_sampled_gpu"):
            assert torch.equal(
                getattr(engine.runner.states, name), getattr(eager.runner.states, name)
            ), name
        _assert_same_histories(engine.runner.states, eager.runner.states)
        blocks, offsets = _computed_kv_slots(eager.runner.states)
        for got, want in zip(engine.kv_caches, eager.kv_caches):
            # [2, num_blocks, block_size, ...]: what each row computed; past it a rejected
            # draft's KV waits to be overwritten, and the drafts depend on when they ran
            torch.testing.assert_close(
                got[:, blocks, offsets], want[:, blocks, offsets], rtol=1e-5, atol=1e-5
            )
    assert torch.equal(graphed.runner.states.token_ids_gpu, eager.runner.states.token_ids_gpu)


def _computed_kv_slots(states: Any) -> tuple[list[int], list[int]]:
    """(block id, offset) of every position a live row has computed, as two index lists."""
    blocks, offsets = [], []
    for row in states.row_of.values():
        for position in range(int(states.num_computed_gpu[row])):
            blocks.append(int(states.block_table_gpu[row, position // BLOCK_SIZE]))
            offsets.append(position % BLOCK_SIZE)
    return blocks, offsets


def _assert_same_histories(got: object, want: object) -> None:
    """The token histories agree up to each row's length: past it a row holds what its
    proposals last wrote there, which depends on when they ran (drafts are proposed before
    a uniform step, after a tail)."""
    for row in range(MAX_REQS):
        length = int(want.total_len_gpu[row])
        assert torch.equal(got.token_ids_gpu[row, :length], want.token_ids_gpu[row, :length]), row


def test_tail_graphs_emit_what_the_eager_tail_emits() -> None:
    _check_tail_graphs_match_the_eager_tail("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_tail_graphs_emit_what_the_eager_tail_emits_on_cuda() -> None:
    _check_tail_graphs_match_the_eager_tail("cuda")
