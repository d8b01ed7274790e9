"""ngram speculative decoding end to end through the offline API, on CPU: greedy tokens
equal those without speculation on both runners, seeded sampling is reproducible and
follows the non-speculative distribution, and preemptions and aborts leave nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

import anyio
import pytest
import torch

from actors.inprocess_engine import InProcessEngine
from actors.protocol.messages import EngineRequest, StepStats
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.speculative_config import SpeculativeConfig
from app.llm import LLM, RequestOutput
from tests.app._server_fixtures import shared_llm
from tests.gpu._tiny_checkpoints import tiny_hf_model, write_tiny_gguf

pytestmark = pytest.mark.slow

NGRAM = SpeculativeConfig(
    "ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4
)
# float32 (--quantization none): a verify pass sums attention in another order than plain
# decoding, which float32 keeps within 1e-3 in logprob; the packed int4 default's bf16
# activations turned it into 1.5e-3 (and could flip a near-tie).
OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, quantization="none")
TEXT = (
    "The committee met on Tuesday to review the budget. It agreed to fund the new library "
    "wing, the park renovation and the bus shelters on Main Street, and it asked the "
    "treasurer to report back in March with the final costs."
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _accepted(stats: tuple[StepStats, ...]) -> tuple[int, int]:
    steps = [s.spec for s in stats if s.spec is not None]
    return sum(s.num_draft_tokens for s in steps), sum(s.num_accepted_tokens for s in steps)


@pytest.fixture(scope="module")
def plain() -> LLM:
    """The session's float32 model (shared_llm skips where it is not installed)."""
    return LLM("default", reuse=shared_llm(), runner="v2", **OPTIONS)


def _prompts(llm: LLM) -> list[str]:
    return [
        llm.apply_chat_template(f"Repeat this text word for word: {TEXT}"),
        llm.apply_chat_template(f"Fix the spelling, keep everything else: {TEXT}"),
        llm.apply_chat_template("Tell me one fact about the moon."),
    ]


def _tokens(outputs) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outputs]


class PlainGreedy(NamedTuple):
    """What the prompts give without speculation (computed once for both runners)."""

    tokens: list[tuple[int, ...]]
    first_alone: tuple[int, ...]
    """The first prompt's tokens when it runs alone,"""
    first_alone_steps: int
    """and the number of steps that took."""


@pytest.fixture(scope="module")
def plain_greedy(plain: LLM) -> PlainGreedy:
    tokens = _tokens(plain.generate(_prompts(plain), GREEDY))
    [first_alone] = _tokens(plain.generate(_prompts(plain)[:1], GREEDY))
    return PlainGreedy(tokens, first_alone, len(plain.last_step_stats))


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_greedy_tokens_equal_those_without_speculation(
    plain: LLM, plain_greedy: PlainGreedy, runner: str
) -> None:
    spec = LLM("default", reuse=plain, runner=runner, speculative_config=NGRAM, **OPTIONS)
    expected = plain_greedy.tokens
    assert _tokens(spec.generate(_prompts(plain), GREEDY)) == expected
    num_drafts, num_accepted = _accepted(spec.last_step_stats)
    assert num_accepted > 0 and num_drafts >= num_accepted
    # Alone, a copying request takes fewer steps than it emits tokens.
    assert [plain_greedy.first_alone] == expected[:1]
    assert _tokens(spec.generate(_prompts(plain)[:1], GREEDY)) == expected[:1]
    assert len(spec.last_step_stats) < plain_greedy.first_alone_steps


def test_logprobs_and_stop_tokens_follow_the_emitted_tokens(plain: LLM) -> None:
    spec = LLM("default", reuse=plain, runner="v2", speculative_config=NGRAM, **OPTIONS)
    prompt = _prompts(plain)[:1]
    expected = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, logprobs=2))
    got = spec.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, logprobs=2))
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    want = expected[0].outputs[0].logprobs
    have = got[0].outputs[0].logprobs
    assert len(have) == len(want) == 30
    for entry, reference in zip(have, want):
        assert (entry.token_id, entry.rank) == (reference.token_id, reference.rank)
        assert [t.token for t in entry.top_logprobs] == [t.token for t in reference.top_logprobs]
        assert entry.logprob == pytest.approx(reference.logprob, abs=1e-3)
    stop_at = expected[0].outputs[0].token_ids[12]
    stopped = spec.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_at,))
    )
    first = expected[0].outputs[0].token_ids.index(stop_at)
    assert stopped[0].outputs[0].token_ids == expected[0].outputs[0].token_ids[: first + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"


# ---- seeded sampling on a tiny model (vocabulary 128) ---------------------------------

BIASED = tuple((token, 20.0) for token in (5, 7, 9, 11))
"""Four likely tokens: ngram drafts find matches and get accepted often."""
PATTERN = [5, 9, 5, 9, 7, 5, 9, 5, 9, 7] * 3
NUM_SEEDS = 400


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(tiny_hf_model("qwen2"), str(path))
    return path


def _sampled(llm: LLM, seeds: range) -> list[tuple[int, ...]]:
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True, logit_bias=BIASED)
        for seed in seeds
    ]
    return _tokens(llm.generate([PATTERN] * len(params), params))


def _homogeneity_p_value(sample_a: list[int], sample_b: list[int]) -> float:
    """Chi-square test that two samples of tokens come from one distribution."""
    counts = torch.stack(
        [torch.bincount(torch.tensor(s), minlength=128) for s in (sample_a, sample_b)]
    )
    table = counts[:, counts.sum(0) > 0].double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    df = torch.tensor(float(table.shape[1] - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_seeded_sampling_is_reproducible_and_keeps_the_distribution(
    tiny_gguf: Path, runner: str
) -> None:
    options = dict(max_model_len=128, max_num_seqs=64, num_kv_blocks=800)
    plain = LLM(str(tiny_gguf), runner=runner, **options)
    spec = LLM(
        str(tiny_gguf),
        reuse=plain,
        runner=runner,
        speculative_config=SpeculativeConfig(
            "ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2
        ),
        **options,
    )
    seeds = range(NUM_SEEDS)
    with_spec = _sampled(spec, seeds)
    num_drafts, num_accepted = _accepted(spec.last_step_stats)
    assert 0 < num_accepted < num_drafts  # both acceptances and rejections happened
    # Same seed, same tokens: the Gumbel draw at a position does not depend on speculation.
    assert with_spec == _sampled(plain, seeds)
    assert _sampled(spec, seeds) == with_spec
    # Against the non-speculative sampler on other seeds, position by position.
    other = _sampled(plain, range(NUM_SEEDS, 2 * NUM_SEEDS))
    for position in (1, 3, 6):
        p_value = _homogeneity_p_value(
            [t[position] for t in with_spec], [t[position] for t in other]
        )
        assert p_value > 1e-3, f"position {position}: p = {p_value}"


# ---- preemption and aborts ------------------------------------------------------------


def test_preemptions_and_aborts_leave_no_block_or_row(plain: LLM) -> None:
    config = plain.config.replace(speculative_config=NGRAM, num_kv_blocks=14, max_num_seqs=4)
    spec = LLM(
        "default",
        reuse=plain,
        **{
            k: getattr(config, k)
            for k in (
                "runner",
                "speculative_config",
                "num_kv_blocks",
                "max_num_seqs",
                "max_num_batched_tokens",
                "max_model_len",
                "quantization",
            )
        },
    )
    prompts = [plain.tokenizer.encode(p) for p in _prompts(plain)] * 2
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    async def run() -> tuple[list[tuple[int, ...]], int, object, object]:
        engine = InProcessEngine(spec.worker, spec.loaded.runner, spec.config)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            try:
                streams = [
                    engine.add_request(EngineRequest(f"r{i}", tuple(p), params, time.monotonic()))
                    for i, p in enumerate(prompts)
                ]
                with anyio.fail_after(300):
                    await streams[4].get()  # r4 and r5 are aborted once r4 is streaming
                    engine.abort(["r4", "r5"])
                    finished = [await stream.wait_finished() for stream in streams[:4]]
                stats = (await engine.client.call("stats")).stats
                invariants = await engine.client.call("check_kv_invariants")
            finally:  # the engine's threads stop only when asked
                engine.stop()
        return [f.token_ids for f in finished], engine.num_preemptions_total, stats, invariants

    tokens, num_preemptions, stats, invariants = anyio.run(run)
    assert num_preemptions > 0
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
    assert stats.num_running == stats.num_waiting == 0
    assert invariants.error is None
    expected = _tokens(plain.generate([list(p) for p in prompts[:4]], params))
    assert [tuple(t) for t in tokens] == expected


def _mixed_params() -> list[SamplingParams]:
    """Greedy, a JSON grammar and prompt logprobs."""
    from actors.protocol.structured_output import StructuredOutputSpec

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    return [
        GREEDY,
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            structured_output=StructuredOutputSpec("json", json.dumps(schema)),
        ),
        SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1),
    ]


@pytest.fixture(scope="module")
def plain_mixed(plain: LLM) -> list[RequestOutput]:
    """What the mixed requests give without speculation (computed once for both runners)."""
    return plain.generate(_prompts(plain), _mixed_params())


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_grammar_and_prompt_logprob_rows_beside_speculating_rows(
    plain: LLM, plain_mixed: list[RequestOutput], runner: str
) -> None:
    # Steps holding such rows run without draft slots (the speculative path applies no mask
    # and scores no prompt): every request still gets exactly what it gets without speculation.
    spec = LLM("default", reuse=plain, runner=runner, speculative_config=NGRAM, **OPTIONS)
    expected = plain_mixed
    actual = spec.generate(_prompts(plain), _mixed_params())
    assert _tokens(actual) == _tokens(expected)
    assert set(json.loads(actual[1].outputs[0].text)) == {"city"}
    assert actual[2].prompt_logprobs == expected[2].prompt_logprobs
    assert actual[2].prompt_logprobs is not None
