"""DecoderModel against transformers on tiny random Llama / Llama-3.1-rope / Qwen2 / Qwen3
models: varlen prefill through a non-contiguous paged KV cache, chunked prefill, and
greedy decoding driven step by step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpu.attention.base import AttentionBackend
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from tests.gpu._paged_kv_batch import PagedKVBook, greedy_decode, model_kv_caches
from tests.gpu._tiny_hf_models import TINY_MODEL_NAMES, build_tiny_hf_model

pytestmark = pytest.mark.slow

NUM_BLOCKS = 96
TinyModel = tuple[Any, ModelConfig, dict[str, torch.Tensor]]
BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,  # on CPU tensors it runs the kernels' torch references
}


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], TinyModel]:
    cache: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in cache:
            hf_model = build_tiny_hf_model(name)
            config = ModelConfig.from_hf_config(hf_model.config.to_dict())
            weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
            cache[name] = (hf_model, config, weights)
        return cache[name]

    return get


def _decoder(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    backend: str = "torch",
    device: str = "cpu",
) -> DecoderModel:
    model = DecoderModel(config, BACKENDS[backend](), torch.float32, device)
    model.load_weights(weights)
    return model


def _prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]


@torch.no_grad()
def _hf_logits(hf_model: Any, prompt: torch.Tensor) -> torch.Tensor:  # [len, vocab] float32
    return hf_model(prompt[None]).logits[0].float()


def _assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    max_diff = (actual.cpu() - expected).abs().max().item()
    assert max_diff < 1e-4 * scale, f"max |diff| {max_diff:.3g} vs logit scale {scale:.3g}"


@torch.no_grad()
def _prefill_logits(
    model: DecoderModel,
    config: ModelConfig,
    prompts: list[torch.Tensor],
    block_size: int,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """All prompts as one flat batch (plus 3 padding tokens); per-prompt logits back."""
    book = PagedKVBook(NUM_BLOCKS, block_size, seed=1)
    num_padding = 3
    positions, metadata = book.step(
        [(f"req{i}", len(p)) for i, p in enumerate(prompts)],
        num_padding_tokens=num_padding,
        device=device,
    )
    input_ids = torch.cat([*prompts, torch.zeros(num_padding, dtype=torch.int64)]).to(device)
    hidden = model(
        input_ids, positions, model_kv_caches(config, NUM_BLOCKS, block_size, device), metadata
    )
    logits = model.compute_logits(hidden[: metadata.num_actual_tokens])
    assert logits.dtype == torch.float32 and logits.shape == (
        metadata.num_actual_tokens,
        config.vocab_size,
    )
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("torch", id="torch"),
        # The Triton backend's code path; its kernels dispatch to their references off CUDA
        # (the kernels themselves: tests/kernels, tests/gpu/test_torch_attention.py).
        pytest.param("triton", id="triton_backend_on_torch_references"),
    ],
)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_varlen_prefill_matches_transformers(
    tiny_model: Callable[[str], TinyModel], name: str, block_size: int, backend: str
) -> None:
    hf_model, config, weights = tiny_model(name)
    prompts = _prompts([7, 13, 1, 22], config.vocab_size)
    logits = _prefill_logits(_decoder(config, weights, backend), config, prompts, block_size)
    for prompt, prompt_logits in zip(prompts, logits, strict=True):
        _assert_logits_close(prompt_logits, _hf_logits(hf_model, prompt))


def test_llama3_rope_scaling_changes_the_logits(tiny_model: Callable[[str], TinyModel]) -> None:
    # Guards the comparison above: dropping the llama3 scaling must fail the tolerance.
    hf_model, config, weights = tiny_model("llama3_rope")
    prompt = _prompts([22], config.vocab_size)[0]
    plain_rope = _decoder(config.replace(rope_scaling=None), weights)
    [logits] = _prefill_logits(plain_rope, config, [prompt], block_size=4)
    expected = _hf_logits(hf_model, prompt)
    assert (logits - expected).abs().max().item() > 1e-2 * expected.abs().max().item()


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
@torch.no_grad()
def test_chunked_prefill_matches_transformers(
    tiny_model: Callable[[str], TinyModel], name: str
) -> None:
    hf_model, config, weights = tiny_model(name)
    model = _decoder(config, weights)
    kv_caches = model_kv_caches(config, NUM_BLOCKS, 4)
    book = PagedKVBook(NUM_BLOCKS, block_size=4, seed=2)
    prompts = _prompts([22, 19], config.vocab_size, seed=1)
    chunk_lens = [[9, 8, 5], [3, 10, 6]]
    hf_logits = [_hf_logits(hf_model, p) for p in prompts]
    done = [0, 0]
    for step in range(3):
        scheduled = [(f"req{i}", chunk_lens[i][step]) for i in range(2)]
        positions, metadata = book.step(scheduled)
        input_ids = torch.cat(
            [prompts[i][done[i] : done[i] + n] for i, (_, n) in enumerate(scheduled)]
        )
        logits = model.compute_logits(model(input_ids, positions, kv_caches, metadata))
        for i, chunk_logits in enumerate(logits.split([n for _, n in scheduled])):
            _assert_logits_close(chunk_logits, hf_logits[i][done[i] : done[i] + len(chunk_logits)])
            done[i] += len(chunk_logits)
    assert done == [22, 19]


@torch.no_grad()
@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_greedy_decode_matches_transformers_generate(
    tiny_model: Callable[[str], TinyModel], name: str
) -> None:
    hf_model, config, weights = tiny_model(name)
    prompts = _prompts([5, 9, 14], config.vocab_size, seed=2)
    # the third request joins two steps late, so steps mix a prefill with decodes
    outputs = greedy_decode(
        _decoder(config, weights), config, prompts, arrival_steps=[0, 0, 2], num_new_tokens=16,
        num_blocks=NUM_BLOCKS, block_size=4,
    )  # fmt: skip
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_model.generate(prompt[None], max_new_tokens=16, do_sample=False)[
            0, len(prompt) :
        ]
        assert output == expected.tolist()


def test_load_weights_names_missing_unexpected_and_misshaped(
    tiny_model: Callable[[str], TinyModel],
) -> None:
    _, config, weights = tiny_model("qwen2")
    broken = dict(weights)
    del broken["model.layers.1.self_attn.k_proj.bias"]
    broken["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    broken["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 5)
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu")
    with pytest.raises(ValueError) as error:
        model.load_weights(broken)
    message = str(error.value)
    assert "missing (1): model.layers.1.self_attn.k_proj.bias" in message
    assert "unexpected (1): model.layers.0.mlp.extra.weight" in message
    assert (
        f"model.layers.0.mlp.up_proj.weight: expected ({config.intermediate_size}, 64), got (5, 5)"
        in message
    )


def test_tied_lm_head_is_the_embedding_and_accepts_missing_lm_head(
    tiny_model: Callable[[str], TinyModel],
) -> None:
    hf_model, config, weights = tiny_model("qwen3")
    assert config.tie_word_embeddings
    without_head = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    model = _decoder(config, without_head)
    assert model.lm_head is model.embed_tokens
    prompt = _prompts([6], config.vocab_size, seed=4)[0]
    [logits] = _prefill_logits(model, config, [prompt], block_size=4)
    _assert_logits_close(logits, _hf_logits(hf_model, prompt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_triton_backend_on_cuda_matches_transformers(
    tiny_model: Callable[[str], TinyModel], name: str
) -> None:
    hf_model, config, weights = tiny_model(name)
    model = _decoder(config, weights, backend="triton", device="cuda")
    prompts = _prompts([7, 13, 1, 22], config.vocab_size)
    for prompt, logits in zip(
        prompts, _prefill_logits(model, config, prompts, 16, "cuda"), strict=True
    ):
        _assert_logits_close(logits, _hf_logits(hf_model, prompt))
    prompts = _prompts([5, 9, 14], config.vocab_size, seed=2)
    outputs = greedy_decode(
        model, config, prompts, arrival_steps=[0, 0, 2], num_new_tokens=16,
        num_blocks=NUM_BLOCKS, block_size=4, device="cuda",
    )  # fmt: skip
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_model.generate(prompt[None], max_new_tokens=16, do_sample=False)[
            0, len(prompt) :
        ]
        assert output == expected.tolist()
