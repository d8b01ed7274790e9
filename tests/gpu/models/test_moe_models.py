"""DecoderModel against transformers on tiny random Qwen3-MoE (all layers sparse, and mixed
dense/sparse) and gpt-oss (sliding-window and full layers, attention sinks, YaRN, biased
router, experts and o_proj; unquantized and MXFP4 experts), each saved with
save_pretrained and read back through tandem's Hugging Face loader: varlen prefill past the
sliding window through a paged KV cache, chunked prefill, and greedy decoding."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.models.moe import SparseMoE
from gpu.weights.hf_loader import load_hf_dir
from tests.gpu._paged_kv_batch import PagedKVBook, greedy_decode, model_kv_caches
from tests.gpu.models._tiny_moe_models import (
    SLIDING_WINDOW,
    TINY_MOE_NAMES,
    save_tiny_moe_checkpoint,
)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 96
BLOCK_SIZE = 4
# (transformers model, tandem config, weights as tandem's loader read them)
Tiny = tuple[Any, ModelConfig, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Tiny]:
    cache: dict[str, Tiny] = {}

    def get(name: str) -> Tiny:
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            hf_model = save_tiny_moe_checkpoint(name, directory)
            config, weights, _ = load_hf_dir(str(directory), torch.float32)
            cache[name] = (hf_model, config, weights)
        return cache[name]

    return get


ALL_NAMES = (*TINY_MOE_NAMES, "gpt_oss_mxfp4")


def _decoder(config: ModelConfig, weights: dict[str, torch.Tensor]) -> DecoderModel:
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu")
    model.load_weights(weights)
    return model


def _prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]


@torch.no_grad()
def _hf_logits(hf_model: Any, prompt: torch.Tensor) -> torch.Tensor:  # [len, vocab]
    return hf_model(prompt[None]).logits[0].float()


def _max_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual - expected).abs().max().item()


@torch.no_grad()
def _prefill_logits(
    model: DecoderModel, config: ModelConfig, prompts: list[torch.Tensor]
) -> list[torch.Tensor]:
    """All prompts as one flat batch (plus 3 padding tokens); per-prompt logits back."""
    book = PagedKVBook(NUM_BLOCKS, BLOCK_SIZE, seed=1)
    positions, metadata = book.step(
        [(f"req{i}", len(p)) for i, p in enumerate(prompts)], num_padding_tokens=3
    )
    input_ids = torch.cat([*prompts, torch.zeros(3, dtype=torch.int64)])
    hidden = model(input_ids, positions, model_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE), metadata)
    logits = model.compute_logits(hidden[: metadata.num_actual_tokens])
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("name", ALL_NAMES)
def test_varlen_prefill_matches_transformers(tiny: Callable[[str], Tiny], name: str) -> None:
    hf_model, config, weights = tiny(name)
    prompts = _prompts([7, 3 * SLIDING_WINDOW + 5, 1, 13], config.vocab_size)
    for prompt, logits in zip(
        prompts, _prefill_logits(_decoder(config, weights), config, prompts), strict=True
    ):
        assert _max_diff(logits, _hf_logits(hf_model, prompt)) <= 1e-4


def test_the_configs_exercise_what_they_claim(tiny: Callable[[str], Tiny]) -> None:
    _, mixed, _ = tiny("qwen3_moe_mixed")
    assert [mixed.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert not mixed.norm_topk_prob
    for name in ("gpt_oss", "gpt_oss_mxfp4"):
        _, config, weights = tiny(name)
        assert config.layer_types == ("sliding_attention", "full_attention") * 2
        assert config.sliding_window == SLIDING_WINDOW and config.attention_sinks
        assert config.mxfp4_experts == (name == "gpt_oss_mxfp4")
        blocks = weights.get("model.layers.0.mlp.experts.gate_up_proj_blocks")
        assert (blocks is not None and blocks.dtype == torch.uint8) == config.mxfp4_experts


@pytest.mark.parametrize(
    "change",
    ["no_sliding_window", "no_sinks", "plain_rope", "no_router_bias", "interleaved_as_stacked"],
)
def test_each_gpt_oss_feature_moves_the_logits(tiny: Callable[[str], Tiny], change: str) -> None:
    # Guards the comparisons above: getting any one feature wrong must fail them.
    hf_model, config, weights = tiny("gpt_oss")
    weights = dict(weights)
    if change == "no_sliding_window":
        config = config.replace(layer_types=None)
    elif change == "plain_rope":
        config = config.replace(rope_scaling=None)
    elif change == "interleaved_as_stacked":  # gate rows read as the first half, up as the second
        name = "model.layers.1.mlp.experts.gate_up_proj"
        gate_up = weights[name]  # [E, hidden, 2I]
        width = gate_up.shape[-1] // 2
        weights[name] = torch.stack((gate_up[..., :width], gate_up[..., width:]), -1).flatten(-2)
    model = _decoder(config, weights)
    for layer in model.layers:
        if change == "no_sinks":
            layer.self_attn.sinks = None
        if change == "no_router_bias":
            assert isinstance(layer.mlp, SparseMoE)
            layer.mlp.router_bias = None
    prompt = _prompts([3 * SLIDING_WINDOW + 5], config.vocab_size)[0]
    [logits] = _prefill_logits(model, config, [prompt])
    assert _max_diff(logits, _hf_logits(hf_model, prompt)) > 1e-2


@pytest.mark.parametrize("name", ["qwen3_moe_mixed", "gpt_oss"])
@torch.no_grad()
def test_chunked_prefill_matches_transformers(tiny: Callable[[str], Tiny], name: str) -> None:
    hf_model, config, weights = tiny(name)
    model = _decoder(config, weights)
    kv_caches = model_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    book = PagedKVBook(NUM_BLOCKS, BLOCK_SIZE, seed=2)
    prompts = _prompts([22, 19], config.vocab_size, seed=1)
    chunk_lens = [[9, 8, 5], [3, 10, 6]]  # chunks that start past the window and cross it
    expected = [_hf_logits(hf_model, p) for p in prompts]
    done = [0, 0]
    for step in range(3):
        scheduled = [(f"req{i}", chunk_lens[i][step]) for i in range(2)]
        positions, metadata = book.step(scheduled)
        input_ids = torch.cat(
            [prompts[i][done[i] : done[i] + n] for i, (_, n) in enumerate(scheduled)]
        )
        logits = model.compute_logits(model(input_ids, positions, kv_caches, metadata))
        for i, chunk in enumerate(logits.split([n for _, n in scheduled])):
            assert _max_diff(chunk, expected[i][done[i] : done[i] + len(chunk)]) <= 1e-4
            done[i] += len(chunk)


@torch.no_grad()
@pytest.mark.parametrize("name", ALL_NAMES)
def test_greedy_decode_matches_transformers_generate(
    tiny: Callable[[str], Tiny], name: str
) -> None:
    hf_model, config, weights = tiny(name)
    prompts = _prompts([5, 9, 14], config.vocab_size, seed=2)
    num_new = 24  # every request decodes well past the sliding window
    # the third request joins two steps late, so steps mix a prefill with decodes
    outputs = greedy_decode(
        _decoder(config, weights), config, prompts, [0, 0, 2], num_new, NUM_BLOCKS, BLOCK_SIZE
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_model.generate(prompt[None], max_new_tokens=num_new, do_sample=False)
        assert output == expected[0, len(prompt) :].tolist()


def test_consuming_load_frees_each_tensor_and_matches_a_copying_load(
    tiny: Callable[[str], Tiny],
) -> None:
    _, config, weights = tiny("gpt_oss_mxfp4")
    reference = _decoder(config, weights)
    source = {name: tensor.clone() for name, tensor in weights.items()}
    alive = {name: weakref.ref(tensor) for name, tensor in source.items()}
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu")
    assert not any(isinstance(m, SparseMoE) and m.is_materialized for m in model.modules())
    model.load_weights(source, consume=True)
    assert source == {} and all(ref() is None for ref in alive.values())
    for (name, param), expected in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        assert torch.equal(param, expected), name
