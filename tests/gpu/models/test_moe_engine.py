"""Qwen3-MoE and gpt-oss end to end through the engine on CPU, against transformers on the
same tiny random checkpoints: greedy tokens of both runners equal `generate`'s, token for
token, with prompts longer than gpt-oss's sliding window prefilled in chunks beside running
decodes; the prompt's teacher-forced log-probabilities equal transformers'; and the V1
runner's --compile-level refuses these models in one line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from gpu.models.config import UnsupportedModelError
from tests.gpu.models._tiny_moe_models import SLIDING_WINDOW, save_tiny_moe_checkpoint

pytestmark = pytest.mark.slow

NAMES = ("qwen3_moe", "qwen3_moe_mixed", "gpt_oss", "gpt_oss_mxfp4")
NUM_NEW_TOKENS = 32
# Chunks of 16 prompt tokens: the long prompts prefill over several steps, beside decodes.
OPTIONS = dict(
    device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
    max_num_batched_tokens=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, str]]:
    cache: dict[str, tuple[Any, str]] = {}

    def get(name: str) -> tuple[Any, str]:
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            cache[name] = (save_tiny_moe_checkpoint(name, directory), str(directory))
        return cache[name]

    return get


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = (3 * SLIDING_WINDOW + 5, 4, SLIDING_WINDOW + 1)  # past the window, short, at it
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _hf_greedy(hf_model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_both_runners_decode_what_transformers_generates(
    checkpoint: Callable[[str], tuple[Any, str]], name: str
) -> None:
    hf_model, directory = checkpoint(name)
    prompts = _prompts(hf_model.config.vocab_size)
    expected = [_hf_greedy(hf_model, prompt) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    v2 = LLM(directory, runner="v2", **OPTIONS)
    v1 = LLM(directory, reuse=v2, runner="v1", **OPTIONS)
    for llm in (v2, v1):
        outputs = llm.generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        # the long prompt was prefilled in chunks, one of them beside decoding requests
        mixed = [s for s in llm.last_step_stats if 0 < s.num_prefill_tokens < s.num_tokens]
        assert mixed, llm.last_step_stats


@pytest.mark.parametrize("name", ["qwen3_moe_mixed", "gpt_oss"])
def test_prompt_logprobs_equal_transformers(
    checkpoint: Callable[[str], tuple[Any, str]], name: str
) -> None:
    hf_model, directory = checkpoint(name)
    prompt = _prompts(hf_model.config.vocab_size)[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])
    llm = LLM(directory, runner="v2", **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    output = llm.generate([prompt], params)[0]
    entries = output.prompt_logprobs[1:]
    assert [entry.token_id for entry in entries] == prompt[1:]
    got = torch.tensor([entry.logprob for entry in entries])
    torch.testing.assert_close(got, expected[:, 0], rtol=0, atol=1e-4)


def test_compile_level_refuses_moe_models(checkpoint: Callable[[str], tuple[Any, str]]) -> None:
    _, directory = checkpoint("gpt_oss")
    with pytest.raises(UnsupportedModelError, match="--compile-level 1 cannot compile gpt_oss"):
        LLM(directory, runner="v1", compile_level=1, **OPTIONS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen3_moe_mixed", "gpt_oss_mxfp4"])
def test_cuda_graphs_and_triton_kernels_decode_what_transformers_generates(
    checkpoint: Callable[[str], tuple[Any, str]], name: str
) -> None:
    """On CUDA the routing, fused experts and windowed/sink attention run as Triton kernels,
    captured in V2's step graphs (float32, so that transformers' tokens are the reference)."""
    hf_model, directory = checkpoint(name)
    prompts = _prompts(hf_model.config.vocab_size)
    expected = [_hf_greedy(hf_model, prompt) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    cuda = {**OPTIONS, "device": "cuda"}
    v2 = LLM(directory, runner="v2", **cuda)
    v1 = LLM(directory, reuse=v2, runner="v1", **cuda)
    for llm in (v2, v1):
        outputs = llm.generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    v2.close()
