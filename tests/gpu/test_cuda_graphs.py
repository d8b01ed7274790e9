"""Decode CUDA graphs: capture sizes, padding, and that a padded (graph) decode step gives the
real rows exactly what an unpadded eager step gives, without touching the KV cache of
anything but the real tokens. On CPU the graph's step runs eagerly on the same padded
buffers and capture-time metadata; the gpu-marked test captures real graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.messages import CachedRequestData, NewRequestData, SchedulerOutput
from actors.sampling_params import SamplingParams
from gpu.attention.base import allocate_kv_cache
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.cuda_graphs import DecodeGraphs, capture_sizes, padded_batch_size
from gpu.input_buffers import InputBuffers
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.runner_v2.input_batch import build_input_batch
from gpu.runner_v2.states import RequestStates
from gpu.weights.dummy import dummy_weights
from kernels.post_update import post_update

TINY = ModelConfig(architecture="qwen3", vocab_size=96, hidden_size=64, intermediate_size=96,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=256, tie_word_embeddings=True, qk_norm=True)
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
MAX_REQS = 8
NUM_BLOCKS = 64


def test_capture_sizes_follow_the_documented_ladder() -> None:
    expected_to_256 = [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    expected_above = list(range(320, 1025, 64))
    assert capture_sizes(1024, 16384) == tuple(expected_to_256 + expected_above)
    assert capture_sizes(100, 2048) == (1, 2, 4, 8, 16, 32, 64, 96, 100)
    assert capture_sizes(256, 48) == (1, 2, 4, 8, 16, 32, 48)  # the token budget caps it
    assert capture_sizes(3, 2048) == (1, 2, 3)


def test_padded_batch_size_is_the_smallest_size_that_fits() -> None:
    sizes = (1, 2, 4, 8, 16)
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]
    assert padded_batch_size(sizes, 17) is None


def test_step_meta_larger_than_the_buffers_is_refused() -> None:
    buffers = InputBuffers(4, 32, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the buffers' max_num_reqs 4"):
        buffers.upload_step_meta(np.arange(5, dtype=np.int32), np.arange(6, dtype=np.int32))


class _Setup:
    """A tiny model with three requests whose prompts are cached but for the last token."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.model = DecoderModel(TINY, TritonAttentionBackend(), torch.float32, self.device)
        self.model.load_weights(dummy_weights(TINY, torch.float32, self.device, seed=3))
        self.kv_caches = allocate_kv_cache(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE,
                                           TINY.num_kv_heads, TINY.head_dim, torch.float32,
                                           self.device)
        for cache in self.kv_caches:
            cache.normal_()  # stale data a padding row must never read or overwrite
        max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
        self.buffers = InputBuffers(MAX_REQS, 64, max_blocks, self.device)
        self.states = RequestStates(MAX_REQS, MAX_MODEL_LEN, max_blocks, self.device)
        generator = np.random.default_rng(0)
        free_blocks = list(generator.permutation(np.arange(1, NUM_BLOCKS)))
        self.request_ids = ("a", "b", "c")
        self.prompt_lens = (5, 11, 7)
        for request_id, prompt_len in zip(self.request_ids, self.prompt_lens):
            blocks = tuple(int(free_blocks.pop()) for _ in range(-(-prompt_len // BLOCK_SIZE)))
            tokens = tuple(int(t) for t in generator.integers(0, TINY.vocab_size, prompt_len))
            self.states.add(NewRequestData(request_id, tokens, prompt_len, blocks, 0,
                                           SamplingParams()))
        self.states.apply_staged()
        self._run_prefill()

    def sched(self, step_id: int, num_scheduled: tuple[int, ...],
              num_computed: tuple[int, ...]) -> SchedulerOutput:
        return SchedulerOutput(step_id, (), CachedRequestData(), self.request_ids, num_scheduled,
                               num_computed, (False,) * len(num_scheduled), frozenset())

    def _run_prefill(self) -> None:
        chunk = tuple(n - 1 for n in self.prompt_lens)
        batch = build_input_batch(self.sched(0, chunk, (0, 0, 0)), self.states, self.buffers,
                                  BLOCK_SIZE)
        self.model(batch.input_ids_gpu, batch.positions_gpu, self.kv_caches, batch.attn_metadata)
        unused = torch.zeros(3, dtype=torch.int64, device=self.device)
        post_update(batch.idx_mapping_gpu, batch.query_start_loc_gpu, unused,
                    self.states.num_computed_gpu, self.states.total_len_gpu,
                    self.states.token_ids_gpu, self.states.last_sampled_gpu, num_reqs=3)

    def decode_sched(self) -> SchedulerOutput:
        return self.sched(1, (1, 1, 1), tuple(n - 1 for n in self.prompt_lens))


def _check_padded_decode_matches_eager(device: str) -> None:
    setup = _Setup(device)
    graphs = DecodeGraphs(setup.model.forward, setup.kv_caches, setup.buffers, (1, 2, 4, 8),
                          MAX_MODEL_LEN)
    graphs.capture()
    kv_before = [cache.clone() for cache in setup.kv_caches]

    batch = build_input_batch(setup.decode_sched(), setup.states, setup.buffers, BLOCK_SIZE, graphs)
    assert batch.num_reqs_padded == 4
    assert setup.buffers.seq_lens[3].item() == 0 and setup.buffers.slot_mapping[3].item() == -1
    assert not setup.buffers.block_table[3].any()
    hidden_graph = graphs.run(3).clone()
    real_slots = setup.buffers.slot_mapping[:3].clone()

    eager = build_input_batch(setup.decode_sched(), setup.states, setup.buffers, BLOCK_SIZE)
    assert eager.num_reqs_padded is None
    hidden_eager = setup.model(eager.input_ids_gpu, eager.positions_gpu, setup.kv_caches,
                               eager.attn_metadata)
    torch.testing.assert_close(hidden_graph, hidden_eager, rtol=1e-5, atol=1e-5)

    for before, after in zip(kv_before, setup.kv_caches):
        per_slot = (before != after).reshape(2, NUM_BLOCKS * BLOCK_SIZE, -1).any(-1).any(0)
        assert torch.nonzero(per_slot).flatten().tolist() == sorted(real_slots.tolist())


def test_padded_decode_step_matches_eager_and_writes_only_real_slots() -> None:
    _check_padded_decode_matches_eager("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_decode_graph_matches_eager_on_cuda() -> None:
    _check_padded_decode_matches_eager("cuda")
