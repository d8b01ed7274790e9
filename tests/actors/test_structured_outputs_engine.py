"""Structured outputs through the whole engine (scheduler, runner, sampler) with the
embedded model on CPU: every output parses and validates against its generated schema,
constrained and free requests share batches, and V1 and V2 give the same tokens."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutputSpec
from app.llm import LLM
from tests._embedded_model import needs_embedded_model
from tests.actors.test_grammar import SCHEMAS
from tests.app._server_fixtures import shared_llm, shared_packed_llm

pytestmark = [pytest.mark.slow, needs_embedded_model]

OPTIONS = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 1024}
MAX_TOKENS = 400
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", reuse=shared_packed_llm(), runner="v2", **OPTIONS)


def _json(schema: dict[str, Any], **params: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        **params,
        structured_output=StructuredOutputSpec("json", json.dumps(schema)),
    )


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schemas=st.lists(SCHEMAS, min_size=4, max_size=6), seed=st.integers(0, 2**31))
def test_every_constrained_output_validates(
    llm: LLM, schemas: list[dict[str, Any]], seed: int
) -> None:
    prompt = llm.apply_chat_template("Describe a thing as JSON.")
    params = [_json(schema, temperature=1.0, seed=seed + i) for i, schema in enumerate(schemas)]
    outputs = llm.generate([prompt] * len(schemas), params)
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_constrained_and_free_requests_share_batches_and_runners_agree() -> None:
    """On float32 weights, as tests/app/_server_fixtures.py says why: the runners put
    different numbers of rows in a step, and the packed int4 default multiplies steps of up
    to 8 rows on its int4 kernel and larger ones on its bf16 copy, which round apart (on an
    AMD EPYC host the tokens parted at a near-tie)."""
    float32 = {**OPTIONS, "quantization": "none"}
    llm = LLM("default", reuse=shared_llm(), runner="v2", **float32)
    v1 = LLM("default", reuse=llm, runner="v1", **float32)
    prompts = [
        llm.apply_chat_template(q)
        for q in (
            "Ada is 36. Give her name and age as JSON.",
            "Tell me about the moon.",
            "Is the sky green? Answer yes or no.",
            "Bob is 41 years old.",
        )
    ]
    params = [
        _json(PERSON, temperature=0.0),
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            structured_output=StructuredOutputSpec("choice", '["yes", "no"]'),
        ),
        _json(PERSON, temperature=0.0, logprobs=2),
    ]
    v2_outputs = llm.generate(prompts, params)
    v1_outputs = v1.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in v1_outputs] == [
        o.outputs[0].token_ids for o in v2_outputs
    ]
    person, free, choice, logged = (o.outputs[0] for o in v2_outputs)
    for completion in (person, logged):
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    # The logprobs are those of the masked distribution the token was drawn from.
    assert all(entry.logprob > -1e9 for entry in logged.logprobs)
