"""Loading --logits-processors entries and validating requests with them: what the engine
core does at startup and every API server does per request."""

from __future__ import annotations

import pytest

from actors.protocol.logits_processors import (
    LogitsProcessorLoadError,
    load_logits_processor_classes,
    parse_logits_processor_specs,
    validate_request_params,
)
from actors.protocol.sampling_params import SamplingParams, SamplingParamsError
from tests.gpu._sample_logits_processor import ForceOrBanTokens

SAMPLE = "tests.gpu._sample_logits_processor:ForceOrBanTokens"


def test_specs_and_loading_errors_name_the_culprit() -> None:
    assert parse_logits_processor_specs(f" {SAMPLE} ,, {SAMPLE}") == (SAMPLE, SAMPLE)
    assert load_logits_processor_classes((SAMPLE,)) == (ForceOrBanTokens,)
    with pytest.raises(LogitsProcessorLoadError, match="must have the form module:Class"):
        parse_logits_processor_specs("just_a_module")
    with pytest.raises(LogitsProcessorLoadError, match="cannot import module 'no_such_mod'"):
        load_logits_processor_classes(("no_such_mod:X",))
    with pytest.raises(LogitsProcessorLoadError, match="has no 'Missing'"):
        load_logits_processor_classes(("tests.gpu._sample_logits_processor:Missing",))
    with pytest.raises(LogitsProcessorLoadError, match="is not a subclass of"):
        load_logits_processor_classes(("tests.gpu._sample_logits_processor:BatchUpdate",))


def test_request_arguments_are_validated_by_the_processors() -> None:
    validate_request_params((SAMPLE,), SamplingParams(extra_args={"force_token_id": 3}))
    validate_request_params((), SamplingParams(extra_args={"force_token_id": "x"}))
    with pytest.raises(SamplingParamsError, match="force_token_id must be a non-negative") as info:
        validate_request_params((SAMPLE,), SamplingParams(extra_args={"force_token_id": "x"}))
    assert info.value.param == "vllm_xargs"
