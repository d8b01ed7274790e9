"""--compile-level on the V1 runner, with the embedded model on CPU: the same greedy tokens
as eager, compiled once at startup (one graph per piece, every batch size), nothing
compiled while serving. Compiling on CPU takes tens of seconds, so there is one test."""

from __future__ import annotations

import pytest
import torch

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from tests._embedded_model import needs_embedded_model
from tests.app._server_fixtures import shared_llm

pytestmark = [pytest.mark.slow, needs_embedded_model]

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Tell me one fact about bees.",
    "Please count from one to ten.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# quantization none: the compiled pieces trace float projections, not packed int4 ones
SMALL = dict(
    device="cpu",
    quantization="none",
    max_num_seqs=8,
    max_model_len=512,
    max_num_batched_tokens=512,
)


def test_compiled_v1_matches_eager_and_compiles_only_at_startup() -> None:
    from torch._dynamo.utils import counters

    eager = LLM("default", reuse=shared_llm(), runner="v1", **SMALL)
    prompts = [eager.apply_chat_template(q) for q in QUESTIONS]
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]

    compiled = LLM("default", reuse=eager, compile_level=1, **SMALL)
    assert compiled.runner == "v1" and "stock torch.compile" in compiled.runner_reason
    graphs_before = counters["stats"]["unique_graphs"]
    # The first generate builds the runner, which compiles; the graphs it makes serve
    # prefill batches, decode batches and a single decoding request alike.
    first = [o.outputs[0].token_ids for o in compiled.generate(prompts, GREEDY)]
    graphs_after_startup = counters["stats"]["unique_graphs"]
    alone = compiled.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids
    assert counters["stats"]["unique_graphs"] == graphs_after_startup
    assert graphs_after_startup - graphs_before == 3  # first, middle, last
    assert first == expected and alone == expected[0]
    assert all(len(tokens) == 16 for tokens in first)
    assert torch.is_inference_mode_enabled() is False
