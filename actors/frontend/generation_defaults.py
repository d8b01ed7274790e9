"""OpenAI request fields -> SamplingParams, with the model's generation defaults.

Each parameter comes from the request when it sets one (a JSON null counts as unset),
then from the model's generation_config.json (temperature, top_p, top_k, min_p,
repetition_penalty, max_new_tokens), then from the OpenAI defaults (SamplingParams'
defaults; `RequestDefaults.max_tokens` for max_tokens). Every bad value raises
SamplingParamsError with `param` naming the request field (OpenAI error `param`).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.protocol.config import DEFAULT_MAX_LOGPROBS
from actors.protocol.sampling_params import SamplingParams, SamplingParamsError

_MODEL_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> SamplingParams field."""
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
MAX_SHOWN_CHARS = 80
"""A bad value is quoted in its error abridged to about this many characters (a logit_bias
key may be megabytes long)."""
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = _SHORT_REPR.maxlong = MAX_SHOWN_CHARS
_INT_FIELDS = ("n", "top_k", "min_tokens", "seed", "prompt_logprobs")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    vocab_size: int
    """Token ids in logit_bias and stop_token_ids must be below this."""
    max_tokens: int | None = None
    """When neither the request nor the model sets one; None runs up to the context length
    (chat), the completions API uses 16."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """The server's --max-logprobs: the most logprobs per token a request may ask for, in
    logprobs / top_logprobs and in prompt_logprobs; -1: up to the vocabulary size."""

    @property
    def logprobs_limit(self) -> int:
        return logprobs_limit(self.max_logprobs, self.vocab_size)


def logprobs_limit(max_logprobs: int, vocab_size: int) -> int:
    """The most logprobs per token a request may ask for under --max-logprobs. Never above
    the vocabulary: the engine core takes the top k of a row of logits and trusts the front
    end to have bounded k."""
    if max_logprobs < 0:
        return vocab_size
    return min(max_logprobs, vocab_size)


def check_logprobs_within(params: SamplingParams, limit: int) -> None:
    """SamplingParams built by a caller rather than by `resolve_sampling_params` (the offline
    LLM) held to the same limit."""
    if params.logprobs is not None:
        check_num_logprobs(params.logprobs, "logprobs", limit)
    if params.prompt_logprobs is not None:
        check_num_logprobs(params.prompt_logprobs, "prompt_logprobs", limit)


def model_sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a model's generation_config.json sets, keyed by SamplingParams
    field. Raises ValueError naming the key when a value has the wrong type."""
    found: dict[str, Any] = {}
    for key, field_name in _MODEL_DEFAULT_FIELDS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        is_int_field = field_name in ("top_k", "max_tokens")
        ok_types = (int,) if is_int_field else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types) or not math.isfinite(value):
            kind = "an integer" if is_int_field else "a finite number"
            raise ValueError(f"generation_config {key} must be {kind}, got {_shown(value)}")
        found[field_name] = value if is_int_field else float(value)
    return found


def resolve_sampling_params(
    request_fields: Mapping[str, Any],
    generation_config: Mapping[str, Any],
    defaults: RequestDefaults,
) -> SamplingParams:
    """Build the SamplingParams of one request. Fields not listed in SamplingParams (and
    unknown fields) are ignored here."""
    fields: dict[str, Any] = {"max_tokens": defaults.max_tokens}
    fields.update(model_sampling_defaults(generation_config))
    for name in _FLOAT_FIELDS:
        value = _get_float(request_fields, name)
        if value is not None:
            fields[name] = value
    for name in _INT_FIELDS:
        value = _get_int(request_fields, name)
        if value is not None:
            fields[name] = value
    for name in _BOOL_FIELDS:
        value = _get_bool(request_fields, name)
        if value is not None:
            fields[name] = value
    max_tokens = _requested_max_tokens(request_fields)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    fields["stop"] = _stop_strings(request_fields.get("stop"))
    fields["stop_token_ids"] = _stop_token_ids(request_fields.get("stop_token_ids"), defaults)
    fields["logit_bias"] = _logit_bias(request_fields.get("logit_bias"), defaults)
    fields["logprobs"] = _num_logprobs(request_fields, defaults)
    if fields.get("prompt_logprobs") is not None:
        check_num_logprobs(fields["prompt_logprobs"], "prompt_logprobs", defaults.logprobs_limit)
    xargs = request_fields.get("vllm_xargs")
    if xargs is not None:
        fields["extra_args"] = dict(xargs)
    return SamplingParams(**fields)


def _get_float(request_fields: Mapping[str, Any], name: str) -> float | None:
    value = request_fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} must be a finite number, got {_shown(value)}")
    return float(value)


def _get_int(request_fields: Mapping[str, Any], name: str) -> int | None:
    value = request_fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"{name} must be an integer, got {_shown(value)}")
    return value


def _get_bool(request_fields: Mapping[str, Any], name: str) -> bool | None:
    value = request_fields.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be true or false, got {_shown(value)}")
    return value


def _requested_max_tokens(request_fields: Mapping[str, Any]) -> int | None:
    """max_completion_tokens wins over its deprecated alias max_tokens."""
    value = _get_int(request_fields, "max_completion_tokens")
    name = "max_completion_tokens"
    if value is None:
        value, name = _get_int(request_fields, "max_tokens"), "max_tokens"
    if value is not None and value < 1:
        raise SamplingParamsError(name, f"{name} must be at least 1, got {value}")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise SamplingParamsError(
            "stop", f"stop must be a string or a list of strings, got {_shown(value)}"
        )
    if not all(value):
        raise SamplingParamsError("stop", "stop strings must not be empty")
    return tuple(value)


def _token_id(value: Any, param: str, defaults: RequestDefaults) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise SamplingParamsError(
                param, f"{param}: {_shown(value)} is not a token id"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(param, f"{param}: {_shown(value)} is not a token id")
    if not 0 <= value < defaults.vocab_size:
        raise SamplingParamsError(
            param, f"{param}: token id {value} is outside the vocabulary [0, {defaults.vocab_size})"
        )
    return value


def _stop_token_ids(value: Any, defaults: RequestDefaults) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or any(isinstance(v, str) for v in value):
        raise SamplingParamsError(
            "stop_token_ids", f"stop_token_ids must be a list of token ids, got {_shown(value)}"
        )
    return tuple(_token_id(v, "stop_token_ids", defaults) for v in value)


def _logit_bias(value: Any, defaults: RequestDefaults) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise SamplingParamsError(
            "logit_bias",
            f"logit_bias must be an object mapping token ids to biases, got {_shown(value)}",
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token_id = _token_id(key, "logit_bias", defaults)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise SamplingParamsError(
                "logit_bias",
                f"logit_bias for token {token_id} must be a number, got {_shown(bias)}",
            )
        biases[token_id] = float(bias)
    return tuple(sorted(biases.items()))


def _num_logprobs(request_fields: Mapping[str, Any], defaults: RequestDefaults) -> int | None:
    """Chat sends logprobs: bool plus top_logprobs: int; completions send logprobs: int."""
    logprobs = request_fields.get("logprobs")
    top_logprobs = _get_int(request_fields, "top_logprobs")
    if logprobs is None or isinstance(logprobs, bool):
        if not logprobs:
            if top_logprobs:
                raise SamplingParamsError("top_logprobs", "top_logprobs requires logprobs=true")
            return None
        return check_num_logprobs(
            0 if top_logprobs is None else top_logprobs, "top_logprobs", defaults.logprobs_limit
        )
    if not isinstance(logprobs, int):
        raise SamplingParamsError(
            "logprobs", f"logprobs must be a boolean or an integer, got {_shown(logprobs)}"
        )
    return check_num_logprobs(logprobs, "logprobs", defaults.logprobs_limit)


def check_num_logprobs(value: int, param: str, limit: int) -> int:
    """`value` if it is a number of logprobs within `limit` (RequestDefaults.logprobs_limit),
    else SamplingParamsError naming `param` and the limit."""
    if not 0 <= value <= limit:
        raise SamplingParamsError(
            param,
            f"{param} must be in [0, {limit}] (the server's --max-logprobs), got {value}",
        )
    return value


def _shown(value: Any) -> str:
    """`repr(value)`, abridged to about MAX_SHOWN_CHARS."""
    return _SHORT_REPR.repr(value)
