"""A two-turn conversation through the engine core on the embedded model (CPU): turn 2's
prompt is turn 1's prompt + answer + new text, and it reuses turn 1's prompt and answer from
the prefix cache up to the last full block whose KV turn 1 computed, on either runner and
with speculative decoding, with greedy tokens equal to those without prefix caching."""

from __future__ import annotations

import functools
import time

import anyio
import pytest

from actors.core.engine_startup import reuse_engine
from actors.inprocess_engine import InProcessEngine
from actors.protocol.config import EngineConfig
from actors.protocol.messages import EngineRequest
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.speculative_config import SpeculativeConfig
from app.tokenizer_loader import load_tokenizer
from tests.app._server_fixtures import ENGINE, shared_model

pytestmark = pytest.mark.slow

# A small token budget: turn 2's uncached tail runs in chunks. Float32 weights: their
# products do not depend on how many rows a step has (the packed int4 model's do, and a
# speculative step verifies several rows at once), so turn 1's answer is the same with
# and without speculation.
CONFIG = ENGINE.replace(max_num_seqs=4, max_num_batched_tokens=48, quantization="none")
NGRAM = SpeculativeConfig(
    "ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4
)
TEXT = (
    "The committee met on Tuesday to review the budget. It agreed to fund the new library "
    "wing and the park renovation."
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@functools.cache
def _turn_tokens() -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Turn 1's prompt, the user text that follows turn 1's answer in turn 2, and EOS."""
    tokenizer = load_tokenizer(CONFIG.model)
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text word for word: {TEXT}"}],
        add_generation_prompt=True,
    )
    follow_up = "\n<|im_start|>user\nNow say it once more.<|im_end|>\n<|im_start|>assistant\n"
    return (
        tuple(tokenizer.encode(first)),
        tuple(tokenizer.encode(follow_up, False)),
        tuple(tokenizer.eos_token_ids),
    )


def _turn_1_params(num_prompt_tokens: int) -> SamplingParams:
    """At most enough tokens that turn 1 ends one token into a block: the block before it
    is then completed by turn 1's very last step, whose KV the cache must not miss."""
    block_size = CONFIG.block_size
    return SamplingParams(
        temperature=0.0, max_tokens=block_size + (1 - num_prompt_tokens) % block_size
    )


async def _generate(
    engine: InProcessEngine,
    request_id: str,
    prompt: tuple[int, ...],
    params: SamplingParams = GREEDY,
) -> tuple[tuple[int, ...], int]:
    """Greedy output tokens and prefix-cache hit (in tokens) of one request."""
    eos = _turn_tokens()[2]
    stream = engine.add_request(
        EngineRequest(request_id, prompt, params, time.monotonic(), eos_token_ids=eos)
    )
    with anyio.fail_after(300):
        final = await stream.wait_finished()
    assert final is not None and final.finish_reason in ("stop", "length"), final
    return final.token_ids, final.num_cached_tokens


def _two_turns(config: EngineConfig) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(turn 2's prompt, turn 2's answer, turn 2's cached tokens), one engine serving both
    turns, one after the other."""
    loaded = reuse_engine(shared_model(), config)  # the session's float32 model
    prompt_1, follow_up, _ = _turn_tokens()

    async def run() -> tuple[tuple[int, ...], tuple[int, ...], int]:
        engine = InProcessEngine(loaded.worker, loaded.runner, config)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            answer_1, _ = await _generate(engine, "turn-1", prompt_1, _turn_1_params(len(prompt_1)))
            prompt_2 = prompt_1 + answer_1 + follow_up
            answer_2, num_cached = await _generate(engine, "turn-2", prompt_2)
            engine.stop()
        return prompt_2, answer_2, num_cached

    return anyio.run(run)


@functools.cache
def _without_prefix_caching() -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return _two_turns(CONFIG.replace(enable_prefix_caching=False, runner="v2"))


@pytest.mark.parametrize(
    "options",
    [dict(runner="v2"), dict(runner="v1"), dict(runner="v2", speculative_config=NGRAM)],
    ids=["v2", "v1", "v2-ngram"],
)
def test_turn_two_reuses_turn_one_prompt_and_answer(options: dict) -> None:
    prompt_2, answer_2, num_cached = _two_turns(CONFIG.replace(**options))
    expected_prompt_2, expected_answer_2, uncached = _without_prefix_caching()
    assert prompt_2 == expected_prompt_2 and uncached == 0
    prompt_1, follow_up, _ = _turn_tokens()
    num_turn_1_tokens = len(prompt_2) - len(follow_up)
    assert num_turn_1_tokens - len(prompt_1) >= 16  # the answer fills whole blocks
    # Turn 1's last token was sampled but never ran: its KV was not computed.
    block_size = CONFIG.block_size
    assert num_cached == (num_turn_1_tokens - 1) // block_size * block_size
    assert num_cached > len(prompt_1)  # the answer, not just the prompt
    assert answer_2 == expected_answer_2


def test_without_cached_outputs_turn_two_reuses_turn_one_prompt_only() -> None:
    """--no-prefix-caching-outputs: the cache as it was before answers were reused."""
    prompt_2, answer_2, num_cached = _two_turns(
        CONFIG.replace(runner="v2", prefix_caching_outputs=False)
    )
    _, expected_answer_2, _ = _without_prefix_caching()
    prompt_1 = _turn_tokens()[0]
    assert num_cached == len(prompt_1) // CONFIG.block_size * CONFIG.block_size > 0
    assert answer_2 == expected_answer_2
