"""Prompt logprobs from both runners, prefilled in chunks of 8 tokens next to other
requests, against transformers' log_softmax on the same weights; and the planning of which
hidden rows score which prompt positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from gpu.prompt_logprobs import PromptRequest, plan_prompt_rows
from tests._embedded_model import needs_embedded_model
from tests._hf_reference import hf_reference_model
from tests.app._server_fixtures import shared_llm

# quantization none: the float32 model, which transformers' reference computes too
OPTIONS = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 8,
    "max_model_len": 256,
    "quantization": "none",
}
PROMPT = "The capital of France is Paris. The capital of Italy is Rome, and of Spain"


def test_rows_cover_each_chunk_up_to_the_last_prompt_token() -> None:
    wanted = {"a": PromptRequest(2, (10, 11, 12, 13, 14)), "c": PromptRequest(0, (7, 8))}
    # a: chunk [3, 8) of a 5-token prompt (a resumed request: prompt plus outputs);
    # b: no prompt logprobs; c: its whole 2-token prompt.
    rows = plan_prompt_rows(("a", "b", "c"), (3, 0, 0), (5, 4, 2), wanted)
    assert rows is not None and rows.request_ids == ("a", "c")
    assert rows.start_positions.tolist() == [4, 1] and rows.num_rows.tolist() == [1, 1]
    assert rows.hidden_rows.tolist() == [0, 9] and rows.target_ids.tolist() == [14, 8]
    assert rows.num_logprobs == 2
    assert plan_prompt_rows(("a",), (4,), (1,), wanted) is None  # decoding: nothing to score
    assert plan_prompt_rows(("b",), (0,), (4,), {}) is None


@pytest.mark.slow
@needs_embedded_model
def test_both_runners_match_transformers_under_chunked_prefill() -> None:
    llm = LLM("default", reuse=shared_llm(), runner="v2", **OPTIONS)  # the session's float32
    v1 = LLM("default", reuse=llm, runner="v1", **OPTIONS)
    token_ids = tuple(llm.tokenizer.encode(PROMPT))
    assert len(token_ids) > 2 * OPTIONS["max_num_batched_tokens"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4),
        SamplingParams(temperature=0.0, max_tokens=3),
    ]
    prompts = [list(token_ids), "Hello there, how are you today?"]
    with torch.no_grad():
        logits = hf_reference_model()(torch.tensor([token_ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)[:-1]
    for engine in (llm, v1):
        output = engine.generate(prompts, params)
        entries = output[0].prompt_logprobs
        assert entries is not None and len(entries) == len(token_ids) and entries[0] is None
        assert output[1].prompt_logprobs is None
        got = torch.tensor([e.logprob for e in entries[1:]])
        expected = reference.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
        ranks = (reference > expected[:, None]).sum(-1) + 1
        assert [e.rank for e in entries[1:]] == ranks.tolist()
        top = np.asarray([[t.token_id for t in e.top_logprobs] for e in entries[1:]])
        expected_top = reference.topk(4, dim=-1)
        assert (top == expected_top.indices.numpy()).mean() > 0.99  # ties may swap
        assert all(e.token_id == t for e, t in zip(entries[1:], token_ids[1:]))
