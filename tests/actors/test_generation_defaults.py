from __future__ import annotations

import math

import pytest

from actors.frontend.generation_defaults import (
    RequestDefaults,
    model_sampling_defaults,
    resolve_sampling_params,
)
from actors.protocol.sampling_params import SamplingParams, SamplingParamsError

DEFAULTS = RequestDefaults(vocab_size=1000)
MODEL = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 256,
    "do_sample": True,
    "eos_token_id": 2,
}


def test_request_values_win_over_the_model_config():
    params = resolve_sampling_params(
        {
            "temperature": 0.0,
            "top_p": 0.5,
            "top_k": 5,
            "min_p": 0.2,
            "repetition_penalty": 1.3,
            "max_tokens": 7,
        },
        MODEL,
        DEFAULTS,
    )
    assert (
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.repetition_penalty,
        params.max_tokens,
    ) == (0.0, 0.5, 5, 0.2, 1.3, 7)


def test_model_config_fills_what_the_request_leaves_unset_or_null():
    params = resolve_sampling_params({"temperature": None, "top_k": None}, MODEL, DEFAULTS)
    assert (
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.repetition_penalty,
        params.max_tokens,
    ) == (0.6, 0.95, 20, 0.05, 1.1, 256)


def test_openai_defaults_apply_when_neither_sets_a_value():
    params = resolve_sampling_params({}, {}, DEFAULTS)
    openai = SamplingParams()
    assert (
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
        params.n,
        params.logprobs,
        params.stop,
        params.seed,
    ) == (1.0, 1.0, openai.top_k, 0.0, 0.0, 0.0, 1.0, 1, None, (), None)
    assert params.max_tokens is None  # chat: up to the context length


def test_max_tokens_precedence():
    completions = RequestDefaults(vocab_size=1000, max_tokens=16)
    assert resolve_sampling_params({}, {}, completions).max_tokens == 16
    assert resolve_sampling_params({}, {"max_new_tokens": 99}, completions).max_tokens == 99
    assert resolve_sampling_params({"max_tokens": 5}, MODEL, completions).max_tokens == 5
    both = {"max_tokens": 5, "max_completion_tokens": 9}
    assert resolve_sampling_params(both, MODEL, completions).max_tokens == 9


def test_openai_field_conversions():
    params = resolve_sampling_params(
        {
            "stop": "\n\n",
            "seed": -3,
            "logit_bias": {"17": 5, "3": -100.0, 999: 0.5},
            "stop_token_ids": [4, 5],
            "presence_penalty": 1,
            "frequency_penalty": -0.5,
            "n": 2,
            "min_tokens": 3,
            "ignore_eos": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "user": "ignored",
            "unknown_field": [1],
        },
        {},
        DEFAULTS,
    )
    assert params.stop == ("\n\n",)
    assert params.seed == -3
    assert params.logit_bias == ((3, -100.0), (17, 5.0), (999, 0.5))
    assert params.stop_token_ids == (4, 5)
    assert (params.presence_penalty, params.frequency_penalty, params.n, params.min_tokens) == (
        1.0,
        -0.5,
        2,
        3,
    )
    assert params.ignore_eos and params.include_stop_str_in_output
    assert not params.skip_special_tokens
    assert resolve_sampling_params({"stop": ["a", "b"]}, {}, DEFAULTS).stop == ("a", "b")
    assert resolve_sampling_params({"stop": None}, {}, DEFAULTS).stop == ()


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": False}, None),
        ({"logprobs": False, "top_logprobs": 0}, None),
        ({"logprobs": 3}, 3),  # completions: an int
        ({"logprobs": 0}, 0),
        ({}, None),
    ],
)
def test_logprobs_chat_and_completions_styles(fields, expected):
    assert resolve_sampling_params(fields, {}, DEFAULTS).logprobs == expected


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"n": "2"}, "n"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids"),
        ({"stop_token_ids": [1000]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1000": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "high"}}, "logit_bias"),
        ({"logit_bias": {"5": math.inf}}, "logit_bias"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": "5"}, "top_logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"ignore_eos": "true"}, "ignore_eos"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ],
)
def test_every_bad_value_names_its_param(fields, param):
    with pytest.raises(SamplingParamsError) as info:
        resolve_sampling_params(fields, {}, DEFAULTS)
    assert info.value.param == param
    assert str(info.value)


def test_server_max_logprobs_is_enforced():
    small = RequestDefaults(vocab_size=1000, max_logprobs=5)
    assert resolve_sampling_params({"logprobs": True, "top_logprobs": 5}, {}, small).logprobs == 5
    assert resolve_sampling_params({"prompt_logprobs": 5}, {}, small).prompt_logprobs == 5
    for fields, param in [
        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ({"logprobs": 6}, "logprobs"),
        ({"prompt_logprobs": 6}, "prompt_logprobs"),
    ]:
        with pytest.raises(SamplingParamsError, match=r"\[0, 5\]") as info:
            resolve_sampling_params(fields, {}, small)
        assert info.value.param == param


def test_max_logprobs_minus_one_lifts_the_cap_to_the_vocabulary():
    """vLLM's -1; a limit above the vocabulary is the vocabulary too: the core takes the
    top k of a row of vocab_size logits and trusts the front end's bound."""
    for max_logprobs in (-1, 5000):
        unbounded = RequestDefaults(vocab_size=1000, max_logprobs=max_logprobs)
        params = resolve_sampling_params({"logprobs": 1000, "prompt_logprobs": 1000}, {}, unbounded)
        assert params.logprobs == params.prompt_logprobs == 1000
        with pytest.raises(SamplingParamsError, match=r"\[0, 1000\]"):
            resolve_sampling_params({"prompt_logprobs": 1001}, {}, unbounded)


def test_model_sampling_defaults_renames_and_validates():
    assert model_sampling_defaults(MODEL) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 256,
    }
    assert model_sampling_defaults({"temperature": 1}) == {"temperature": 1.0}
    for bad in (
        {"temperature": "0.7"},
        {"top_k": 2.0},
        {"max_new_tokens": True},
        {"top_p": math.nan},
    ):
        with pytest.raises(ValueError, match="generation_config"):
            model_sampling_defaults(bad)
