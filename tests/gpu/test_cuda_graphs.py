"""CUDA graphs of the V2 step: capture sizes, the step plan's padding, and that a runner
replaying graphs (forward, head, sample) gives exactly the tokens of an eager runner,
through decode steps, mixed prefill+decode steps, partial prefill chunks and every
sampling filter, while writing the same KV cache. On CPU the graphs' functions run eagerly
on the same padded buffers (the padding logic is what is tested); the gpu-marked test
captures real graphs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors.protocol.config import EngineConfig
from actors.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from actors.protocol.sampling_params import SamplingParams
from gpu.attention.base import allocate_kv_cache
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.cuda_graphs import StepGraphs, capture_sizes, mixed_capture_sizes
from gpu.input_buffers import InputBuffers
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.runner_v2.runner import ModelRunnerV2
from gpu.runner_v2.step_plan import GraphSizes, padded_batch_size, plan_step
from gpu.runner_v2.step_state import V2StepState
from gpu.weights.dummy import dummy_weights

TINY = ModelConfig(
    architecture="qwen3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    qk_norm=True,
)
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
MAX_REQS = 8
MAX_TOKENS = 64
NUM_BLOCKS = 96
SIZES = GraphSizes(decode=(1, 2, 4, 8), mixed=(16, 32), max_num_reqs=MAX_REQS)


def test_capture_sizes_follow_the_documented_ladder() -> None:
    expected_to_256 = [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    expected_above = list(range(320, 1025, 64))
    assert capture_sizes(1024, 16384) == tuple(expected_to_256 + expected_above)
    assert capture_sizes(100, 2048) == (1, 2, 4, 8, 16, 32, 64, 96, 100)
    assert capture_sizes(256, 48) == (1, 2, 4, 8, 16, 32, 48)  # the token budget caps it
    assert capture_sizes(3, 2048) == (1, 2, 3)
    assert mixed_capture_sizes(256, 2048) == (64, 128, 256, 320, 384, 512, 768, 1024, 1536, 2048)
    assert mixed_capture_sizes(1024, 1000) == (64, 128, 256, 384, 512, 768)


def test_padded_batch_size_is_the_smallest_size_that_fits() -> None:
    sizes = (1, 2, 4, 8, 16)
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]
    assert padded_batch_size(sizes, 17) is None


def test_step_meta_larger_than_the_buffers_is_refused() -> None:
    buffers = InputBuffers(4, 32, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the buffers' max_num_reqs 4"):
        buffers.upload_step_meta(np.arange(5, dtype=np.int32), np.arange(6, dtype=np.int32))


def test_upload_packs_counts_rows_and_padded_query_starts() -> None:
    buffers = InputBuffers(4, 32, 8, torch.device("cpu"))
    buffers.idx_mapping.fill_(7)
    buffers.upload_step_meta(
        np.array([3, 1], dtype=np.int32), np.array([0, 5, 6, 6, 6], dtype=np.int32)
    )
    assert buffers.step_counts.tolist() == [2, 6]
    assert buffers.idx_mapping.tolist() == [3, 1, 0, 0]  # padding rows read row 0
    assert buffers.query_start_loc.tolist() == [0, 5, 6, 6, 6]


def _sched(
    ids: list[str], scheduled: list[int], computed: list[int], new=(), finished=(), samples=None
) -> SchedulerOutput:
    return SchedulerOutput(
        1,
        tuple(new),
        CachedRequestData(),
        tuple(ids),
        tuple(scheduled),
        tuple(computed),
        tuple(samples or [True] * len(ids)),
        frozenset(finished),
    )


def test_plan_pads_decode_steps_to_a_decode_graph() -> None:
    plan = plan_step(_sched(["a", "b", "c"], [1, 1, 1], [4, 9, 2]), {"a": 5, "b": 0, "c": 2}, SIZES)
    assert plan.forward is not None and plan.forward.is_decode and plan.forward.num_tokens == 4
    assert plan.idx_mapping_np.tolist() == [5, 0, 2]
    assert plan.query_start_loc_np.tolist() == [0, 1, 2, 3, 4]  # the padding row has one token
    assert plan.seq_lens_np.tolist() == [5, 10, 3] and plan.num_rows_padded == 4


def test_plan_pads_mixed_steps_by_tokens_with_empty_padding_requests() -> None:
    plan = plan_step(
        _sched(["a", "b", "c"], [1, 12, 1], [4, 0, 2]), {"a": 0, "b": 1, "c": 2}, SIZES
    )
    assert plan.forward is not None and not plan.forward.is_decode
    assert (plan.forward.num_tokens, plan.forward.num_reqs, plan.num_rows_padded) == (16, 8, 4)
    assert plan.query_start_loc_np.tolist() == [0, 1, 13, 14, 14, 14, 14, 14, 14]


def test_plan_runs_eagerly_what_no_graph_holds() -> None:
    rows = {f"r{i}": i for i in range(8)}
    too_long = plan_step(_sched(["r0", "r1"], [40, 30], [0, 0]), rows, SIZES)
    assert too_long.forward is None and too_long.num_rows_padded == 2 and too_long.tail_graphed
    assert too_long.query_start_loc_np.tolist() == [0, 40, 70]
    no_graphs = plan_step(_sched(["r0", "r1", "r2"], [1, 1, 1], [3, 3, 3]), rows, None)
    assert no_graphs.forward is None and not no_graphs.tail_graphed
    assert no_graphs.query_start_loc_np.tolist() == [0, 1, 2, 3] and no_graphs.num_rows_padded == 3


class _Engine:
    """A V2 runner on a tiny model with its own KV cache and step state, with or without
    step graphs (the fake worker holds what the runner borrows)."""

    def __init__(self, model: DecoderModel, device: torch.device, graphs: bool) -> None:
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
            with_graph_outputs=graphs,
        )
        step_graphs = None
        if graphs:
            step_graphs = StepGraphs(model, self.kv_caches, state, SIZES, BLOCK_SIZE, MAX_MODEL_LEN)
            step_graphs.capture()
        config = EngineConfig(
            model="dummy:tiny",
            device=str(device),
            block_size=BLOCK_SIZE,
            max_num_seqs=MAX_REQS,
            max_num_batched_tokens=MAX_TOKENS,
        )
        worker = SimpleNamespace(
            config=config,
            device=device,
            buffers=buffers,
            step_state=state,
            graphs=step_graphs,
            model=model,
            kv_caches=self.kv_caches,
            max_model_len=MAX_MODEL_LEN,
            max_blocks_per_req=MAX_MODEL_LEN // BLOCK_SIZE,
            model_config=TINY,
            dtype=torch.float32,
        )
        self.runner = ModelRunnerV2(worker, config)  # type: ignore[arg-type]

    def step(self, sched: SchedulerOutput) -> list[int]:
        out = self.runner.execute(sched).result()
        assert out.error is None
        return out.sampled_token_ids.tolist()


_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, seed=3),
    SamplingParams(temperature=0.7, seed=4),
    SamplingParams(top_k=5, top_p=0.8, seed=5),
    SamplingParams(temperature=1.2, min_p=0.1, top_k=20, top_p=0.9, seed=6),
    SamplingParams(temperature=0.8, seed=7, repetition_penalty=1.3, logprobs=2),
]


def _script(rng: np.random.Generator) -> list[SchedulerOutput]:
    """Prefill (mixed graph), decodes (decode graphs) sampled in graphs without filters,
    then with them, a partial chunk beside decodes, a step too long for any graph (eager
    forward, graphed sampling rows), then penalties and logprobs (eager sampling), requests
    joining and leaving."""
    prompts = {
        f"r{i}": tuple(int(t) for t in rng.integers(0, TINY.vocab_size, n))
        for i, n in enumerate((5, 11, 7, 9, 30, 6))
    }
    blocks = iter(range(NUM_BLOCKS))

    def new(request_id: str, params: SamplingParams) -> NewRequestData:
        tokens = prompts[request_id]
        return NewRequestData(
            request_id,
            tokens,
            len(tokens),
            tuple(next(blocks) for _ in range(MAX_MODEL_LEN // BLOCK_SIZE)),
            0,
            params,
        )

    steps = [
        _sched(
            ["r0", "r1", "r2"],
            [5, 11, 7],
            [0, 0, 0],
            new=[new("r0", _PARAMS[0]), new("r1", _PARAMS[1]), new("r2", _PARAMS[2])],
        )
    ]
    steps += [_sched(["r0", "r1", "r2"], [1, 1, 1], [5 + i, 11 + i, 7 + i]) for i in range(3)]
    steps.append(
        _sched(
            ["r0", "r1", "r2", "r3"],
            [1, 1, 1, 4],
            [8, 14, 10, 0],
            new=[new("r3", _PARAMS[3])],
            samples=[True, True, True, False],
        )
    )
    steps.append(
        _sched(
            ["r1", "r3", "r4"],
            [1, 5, 30],
            [15, 4, 0],
            new=[new("r4", _PARAMS[4])],
            finished=["r0", "r2"],
        )
    )  # 36 tokens: more than any mixed graph
    steps += [_sched(["r1", "r3", "r4"], [1, 1, 1], [16 + i, 9 + i, 30 + i]) for i in range(2)]
    steps.append(
        _sched(["r1", "r3", "r4", "r5"], [1, 1, 1, 6], [18, 11, 32, 0], new=[new("r5", _PARAMS[5])])
    )
    steps += [
        _sched(["r1", "r3", "r4", "r5"], [1, 1, 1, 1], [19 + i, 12 + i, 33 + i, 6 + i])
        for i in range(3)
    ]
    return steps


def _check_graphed_runner_matches_eager(device: str) -> None:
    device_ = torch.device(device)
    model = DecoderModel(TINY, TritonAttentionBackend(), torch.float32, device_)
    model.load_weights(dummy_weights(TINY, torch.float32, device_, seed=3))
    graphed, eager = _Engine(model, device_, graphs=True), _Engine(model, device_, graphs=False)
    for sched in _script(np.random.default_rng(0)):
        assert graphed.step(sched) == eager.step(sched)
    for got, want in zip(graphed.kv_caches, eager.kv_caches):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The penalty request's output counts hold exactly the tokens it generated.
    runner = graphed.runner
    row = runner.states.row_of["r5"]
    outputs = runner.states.token_ids_gpu[row, 6 : int(runner.states.total_len_gpu[row])].long()
    counts = runner.sampling_state.output_counts_gpu[row]
    assert outputs.numel() == 4 and torch.equal(
        counts,
        torch.bincount(outputs.cpu(), minlength=TINY.vocab_size).to(counts.device, counts.dtype),
    )


def test_graphed_runner_gives_the_eager_runner_tokens() -> None:
    _check_graphed_runner_matches_eager("cpu")


def test_a_second_live_runner_gets_a_private_state_and_a_closed_one_cannot_step() -> None:
    model = DecoderModel(TINY, TritonAttentionBackend(), torch.float32, torch.device("cpu"))
    model.load_weights(dummy_weights(TINY, torch.float32, torch.device("cpu"), seed=3))
    engine = _Engine(model, torch.device("cpu"), graphs=True)
    first = engine.runner
    worker = first.worker
    second = ModelRunnerV2(worker, worker.config)  # the first still holds the shared state
    assert second.step_state is not worker.step_state and second.graphs is None
    script = _script(np.random.default_rng(0))
    assert engine.step(script[0]) and second.execute(script[0]).result().error is None
    first.close()
    with pytest.raises(RuntimeError, match="no longer holds its step state"):
        first.execute(script[1])
    third = ModelRunnerV2(worker, worker.config)  # released: the shared state and its graphs
    assert third.step_state is worker.step_state and third.graphs is worker.graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_give_the_eager_runner_tokens_on_cuda() -> None:
    _check_graphed_runner_matches_eager("cuda")
