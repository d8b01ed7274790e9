"""A model without a tokenizer (dummy weights) serves token ids end to end: the engine
runs, outputs carry token ids and empty text, and text-only features are refused."""

from __future__ import annotations

import pytest

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM

pytestmark = pytest.mark.slow

OPTIONS = dict(max_model_len=128, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("dummy:smollm2-135m", runner="v2", **OPTIONS)


def test_token_id_prompts_give_token_ids_and_no_text(llm: LLM) -> None:
    assert llm.tokenizer is None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([[1, 2, 3], [4, 5]], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    assert all(o.outputs[0].text == "" and o.outputs[0].finish_reason == "length" for o in outputs)
    v1 = LLM("dummy:smollm2-135m", reuse=llm, runner="v1", **OPTIONS)
    assert [o.outputs[0].token_ids for o in v1.generate([[1, 2, 3], [4, 5]], params)] == [
        o.outputs[0].token_ids for o in outputs
    ]
    assert llm.last_step_stats and all(s.num_reqs >= 1 for s in llm.last_step_stats)


def test_text_prompts_and_stop_strings_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="no tokenizer: pass prompts as lists of token ids"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="stop strings cannot be matched"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, stop=["x"]))
