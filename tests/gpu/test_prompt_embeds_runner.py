"""Prompt embeddings through both runners (gpu/prompt_embeds.py), driven by the offline API
on the float32 embedded model: rows equal to the model's own embeddings of some tokens give
exactly those tokens' output, whole or in prefill chunks, next to ordinary requests, after
a preemption and from the prefix cache; the rows really are what the model runs."""

from __future__ import annotations

import pytest
import torch

from actors.core.request import Request
from actors.core.spec_scheduling import speculates
from actors.protocol.config import ConfigError, EngineConfig
from actors.protocol.messages import EngineRequest
from actors.protocol.prompt_embeds import PromptEmbedsError
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.speculative_config import parse_speculative_config
from app.llm import LLM
from app.tokenizer_loader import load_tokenizer
from gpu.prompt_embeds import embeds_from_tensor
from tests._embedded_model import needs_embedded_model
from tests.app._server_fixtures import shared_model
from tests.gpu._tiny_checkpoints import save_sharded, tiny_hf_model

pytestmark = [pytest.mark.slow, needs_embedded_model]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG_IDS = [(7 * i + 300) % 9000 + 50 for i in range(45)]
SHORT_IDS = [1, 2, 3, 4, 5, 6, 7]


def _llm(runner: str, **options: object) -> LLM:
    """An LLM on the session's shared float32 model."""
    base = LLM.__new__(LLM)
    base.loaded = shared_model()
    base.tokenizer = load_tokenizer("default")
    values = dict(quantization="none", max_num_seqs=8, enable_prompt_embeds=True)
    values.update(options)
    return LLM("default", reuse=base, runner=runner, **values)  # type: ignore[arg-type]


def _embeds(llm: LLM, token_ids: list[int]) -> dict[str, torch.Tensor]:
    table = llm.worker.model.embed_tokens
    return {"prompt_embeds": table[torch.tensor(token_ids)].detach().clone()}


def _tokens(outputs) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_tokens_own_embeddings_give_the_tokens_output(runner: str) -> None:
    # 16 tokens a step: the 45-row prompt prefills in three chunks, next to ordinary ones.
    llm = _llm(runner, max_num_batched_tokens=16, enable_prefix_caching=False)
    expected = _tokens(llm.generate([LONG_IDS, SHORT_IDS, SHORT_IDS[:3]], GREEDY))
    mixed = llm.generate([_embeds(llm, LONG_IDS), SHORT_IDS, _embeds(llm, SHORT_IDS[:3])], GREEDY)
    assert _tokens(mixed) == expected
    assert mixed[0].prompt_token_ids == () and mixed[1].prompt_token_ids == tuple(SHORT_IDS)
    assert mixed[0].outputs[0].text == llm.tokenizer.decode(list(expected[0]))
    assert llm.runner == runner


def test_the_rows_are_what_runs_not_the_placeholders() -> None:
    llm = _llm("v2", max_num_batched_tokens=64)
    prompt = _embeds(llm, LONG_IDS)
    shifted = {"prompt_embeds": prompt["prompt_embeds"] * 3.0 + 0.05}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    # The same batch shape each time, so that every chunk sums in the same order.
    same, other = llm.generate([prompt, shifted], params)
    llm.reset_prefix_cache()  # `shifted` would hit its blocks, which sums in another order
    reference = llm.generate([LONG_IDS, shifted], params)[0]
    assert same.outputs[0].logprobs == reference.outputs[0].logprobs
    assert other.outputs[0].logprobs != reference.outputs[0].logprobs


def test_a_preempted_request_recomputes_its_rows() -> None:
    # 8 blocks of 16 tokens hold two 45-token prompts, not their 40 outputs each.
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = _llm("v2", max_num_batched_tokens=2048)
    prompts = [LONG_IDS[i:] + LONG_IDS[:i] for i in range(3)]
    expected = _tokens(reference.generate(prompts, params))
    tiny_pool = _llm("v2", max_num_batched_tokens=2048, num_kv_blocks=8, max_model_len=96)
    outputs = tiny_pool.generate([_embeds(tiny_pool, p) for p in prompts], params)
    assert tiny_pool.last_num_preemptions > 0
    assert _tokens(outputs) == expected


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_prefix_cache_keys_blocks_by_the_rows(runner: str) -> None:
    llm = _llm(runner, max_num_batched_tokens=2048)
    prompt = _embeds(llm, LONG_IDS)
    # A new LLM's first call starts with an empty cache. Neither the same rows' tokens nor
    # the placeholder ids nor other rows share the rows' blocks.
    other = {"prompt_embeds": prompt["prompt_embeds"].flip(0)}
    first, again, tokens, placeholders, flipped = llm.generate(
        [prompt, prompt, LONG_IDS, [0] * len(LONG_IDS), other], GREEDY
    )
    assert sorted((first.num_cached_tokens, again.num_cached_tokens)) == [0, 32]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert tokens.outputs[0].token_ids == first.outputs[0].token_ids
    assert tokens.num_cached_tokens == placeholders.num_cached_tokens == 0
    assert flipped.num_cached_tokens == 0


def test_an_embeds_prompt_never_speculates_from_its_placeholders() -> None:
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    llm = _llm("v2", max_num_batched_tokens=2048, speculative_config=spec)
    repeated = llm.tokenizer.encode("1, 2, 3, 4, 5, " * 4 + "1, 2, 3")
    expected = _tokens(_llm("v2", max_num_batched_tokens=2048).generate([repeated], GREEDY))
    embedded, tokens = llm.generate([_embeds(llm, repeated), repeated], GREEDY)
    assert _tokens([embedded, tokens]) == expected * 2
    assert _num_drafts(llm) > 0  # the token prompt drafts beside it
    embeds = embeds_from_tensor(_embeds(llm, repeated)["prompt_embeds"])
    request = EngineRequest("e", (0,) * embeds.num_tokens, GREEDY, 0.0, prompt_embeds=embeds)
    assert not speculates(Request.from_engine_request(request, 2048, 0.0))
    twin = EngineRequest("t", tuple(repeated), GREEDY, 0.0)
    assert speculates(Request.from_engine_request(twin, 2048, 0.0))


def _num_drafts(llm: LLM) -> int:
    return sum(s.spec.num_draft_tokens for s in llm.last_step_stats if s.spec is not None)


def test_the_offline_api_refuses_what_it_cannot_run() -> None:
    llm = _llm("v2", max_num_batched_tokens=2048)
    hidden = llm.worker.model_config.hidden_size
    with pytest.raises(PromptEmbedsError, match="hidden size"):
        llm.generate([{"prompt_embeds": torch.zeros(3, hidden + 1)}], GREEDY)
    with pytest.raises(PromptEmbedsError, match="NaN"):
        llm.generate([{"prompt_embeds": torch.full((3, hidden), float("nan"))}], GREEDY)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([_embeds(llm, SHORT_IDS)], SamplingParams(max_tokens=2, prompt_logprobs=1))
    with pytest.raises(ValueError, match="exactly the key"):
        llm.generate([{"prompt": "hi"}], GREEDY)
    off = _llm("v2", max_num_batched_tokens=2048, enable_prompt_embeds=False)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        off.generate([_embeds(off, SHORT_IDS)], GREEDY)
    with pytest.raises(ConfigError, match="compile_level"):
        EngineConfig(enable_prompt_embeds=True, compile_level=1)


def test_tensor_parallel_ranks_run_the_rows_too(tmp_path, monkeypatch) -> None:
    # Every rank runs the step's scheduler output, rows included (tiny llama, TP 2 on CPU).
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    save_sharded(tiny_hf_model("llama"), str(tmp_path))
    options = dict(
        device="cpu",
        dtype="float32",
        max_model_len=128,
        block_size=8,
        num_kv_blocks=48,
        max_num_batched_tokens=24,
        enable_prompt_embeds=True,
    )
    prompts = [list(range(40, 70)), [7, 8, 9]]
    single = LLM(str(tmp_path), **options)  # type: ignore[arg-type]
    expected = _tokens(single.generate(prompts, GREEDY))
    rows = [_embeds(single, p) for p in prompts]
    with LLM(str(tmp_path), tensor_parallel_size=2, **options) as sharded:  # type: ignore[arg-type]
        assert _tokens(sharded.generate([rows[0], prompts[1]], GREEDY)) == expected
        assert _tokens(sharded.generate(rows, GREEDY)) == expected
