"""LLM.generate keeps the prefix cache from call to call, as vLLM's LLM does: a chat's next
turn hits the previous call's prompt and answer, from the device pool or the host tier;
`reset_prefix_cache` forgets it, and so does another LLM running on the same loaded model
in between (its steps rewrite the KV blocks the first one's cache points at)."""

from __future__ import annotations

import pytest

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from tests.app._server_fixtures import shared_llm

BLOCK_SIZE = 16
PROMPT = list(range(1000, 1000 + 3 * BLOCK_SIZE + 5))
ANSWER = SamplingParams(temperature=0.0, max_tokens=2 * BLOCK_SIZE, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def _llm(**options: object) -> LLM:
    """The session's float32 model: a hit's tokens equal a full prefill's."""
    return LLM(
        "default",
        reuse=shared_llm(),
        runner="v2",
        quantization="none",
        max_num_seqs=4,
        max_model_len=512,
        **options,
    )


def _turns(llm: LLM) -> tuple[list[int], int]:
    """Turn 2's prompt (turn 1's prompt and answer, then new tokens) and its cached tokens."""
    answer = llm.generate([PROMPT], ANSWER)[0].outputs[0].token_ids
    turn_2 = PROMPT + list(answer) + [7] * BLOCK_SIZE
    return turn_2, llm.generate([turn_2], ONE)[0].num_cached_tokens


PROMPT_BLOCKS = len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
"""The prompt's tokens in whole blocks: what a later prompt starting with it can hit."""
# Turn 1's last token was sampled but never ran: its KV was not computed.
TURN_1_BLOCKS = (len(PROMPT) + ANSWER.max_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.parametrize("cache_outputs", [True, False])
def test_the_next_call_hits_the_previous_calls_prompt_and_answer(cache_outputs: bool) -> None:
    llm = _llm(prefix_caching_outputs=cache_outputs)
    assert llm.config.block_size == BLOCK_SIZE
    turn_2, num_cached = _turns(llm)
    assert num_cached == (TURN_1_BLOCKS if cache_outputs else PROMPT_BLOCKS)
    # The hit changes no token: the same prompt computed whole on a fresh cache.
    hit = llm.generate([turn_2], ANSWER)[0]
    llm.reset_prefix_cache()
    whole = llm.generate([turn_2], ANSWER)[0]
    assert hit.num_cached_tokens > 0 and whole.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == whole.outputs[0].token_ids


def test_another_llm_on_the_same_model_in_between_empties_the_cache() -> None:
    first, second = _llm(), _llm()
    first.generate([PROMPT], ANSWER)
    second.generate([[5] * 40], ANSWER)  # rewrites blocks the first one's cache holds
    assert first.generate([PROMPT], ONE)[0].num_cached_tokens == 0
    # ... and the first one caches again from there.
    assert first.generate([PROMPT], ONE)[0].num_cached_tokens == PROMPT_BLOCKS


def test_the_host_tier_lasts_from_call_to_call_too() -> None:
    # 8 device blocks: a second prompt of 7 evicts the first one's blocks to host memory.
    llm = _llm(num_kv_blocks=8, kv_offload_cpu_bytes=50 << 20)
    first = llm.generate([PROMPT], ONE)[0]
    llm.generate([list(range(2000, 2000 + 7 * BLOCK_SIZE - 4))], ONE)
    again = llm.generate([PROMPT], ONE)[0]
    assert again.num_cached_tokens == PROMPT_BLOCKS
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    kept = llm._prefix_cache  # the KV cache manager's own counts say which tier hit
    assert kept is not None
    (host,) = (t for t in kept.kv.stats().kv_tiers if t.tier == "cpu")
    assert host.hits_tokens >= 2 * BLOCK_SIZE  # the evicted blocks came back from host memory
    llm.reset_prefix_cache()  # both tiers
    assert llm.generate([PROMPT], ONE)[0].num_cached_tokens == 0
