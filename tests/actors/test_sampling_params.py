"""Each invalid sampling parameter is refused with one clear error naming it."""

from __future__ import annotations

import pytest

from actors.protocol.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("seed", 2**64),
        ("stop", ("",)),
        ("logit_bias", ((5, 101.0),)),
    ],
)
def test_invalid_value_names_the_parameter(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field.split("_")[0] in str(info.value)


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"


def test_valid_edges_are_accepted() -> None:
    params = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        logprobs=20,
        max_tokens=None,
        seed=-(2**63),
        repetition_penalty=2.0,
    )
    assert params.is_greedy and not params.uses_top_k
    assert SamplingParams(top_k=5).uses_top_k
    assert SamplingParams(frequency_penalty=0.5).uses_penalties
