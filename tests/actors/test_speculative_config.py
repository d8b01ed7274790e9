"""--speculative-config: vLLM's keys, defaults and checks for ngram drafting."""

from __future__ import annotations

import pytest

from actors.protocol.speculative_config import (
    SpeculativeConfig,
    SpeculativeConfigError,
    parse_speculative_config,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 4}', (4, 5, 5)),
        ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 7}', (3, 7, 7)),
        ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}', (3, 2, 2)),
        (
            '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
            '"prompt_lookup_max": 4}',
            (5, 2, 4),
        ),
        ('{"method": "[ngram]", "num_speculative_tokens": 1}', (1, 5, 5)),
        ('{"method": "ngram_gpu", "num_speculative_tokens": 2}', (2, 5, 5)),
        ('{"model": "[ngram]", "num_speculative_tokens": 2}', (2, 5, 5)),
    ],
)
def test_valid_configs_and_vllm_defaults(text: str, expected: tuple[int, int, int]) -> None:
    config = parse_speculative_config(text)
    assert config.method == "ngram"
    assert (
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
    ) == expected
    assert config.max_tokens_per_decode_step == expected[0] + 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{method: ngram}", "not valid JSON"),
        ('["ngram"]', "must be a JSON object, got list"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
        ('{"num_speculative_tokens": 2}', "method None is not supported"),
        (
            '{"model": "some/draft-model", "num_speculative_tokens": 2}',
            "draft models are not supported",
        ),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        (
            '{"method": "ngram", "num_speculative_tokens": 0}',
            "num_speculative_tokens must be an integer >= 1, got 0",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2.5}',
            "num_speculative_tokens must be an integer, got 2.5",
        ),
        ('{"method": "ngram", "num_speculative_tokens": true}', "must be an integer, got True"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
            "prompt_lookup_min must be an integer >= 1, got 0",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 3}',
            r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(3\)",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
            "unsupported key.s. 'draft_tensor_parallel_size'",
        ),
    ],
)
def test_invalid_configs_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=message):
        parse_speculative_config(text)


def test_the_config_is_frozen_and_validated_on_construction() -> None:
    config = SpeculativeConfig("ngram", 2, 1, 3)
    with pytest.raises(AttributeError):
        config.num_speculative_tokens = 3  # type: ignore[misc]
    with pytest.raises(SpeculativeConfigError):
        SpeculativeConfig("ngram", 2, 3, 1)
