"""`--speculative-config`: which speculative decoding method to run, and its knobs.

The JSON object takes vLLM's keys and defaults for prompt-lookup (ngram) drafting:

    {"method": "ngram", "num_speculative_tokens": K,
     "prompt_lookup_min": a, "prompt_lookup_max": b}

- `method`: "ngram" ("[ngram]" and "ngram_gpu" are accepted spellings of it; tandem
  proposes on the device whenever the runner can). vLLM's legacy form without a method,
  `{"model": "[ngram]", ...}`, means ngram too.
- `num_speculative_tokens` (K): draft tokens proposed per decode step; required, >= 1.
- `prompt_lookup_max` / `prompt_lookup_min`: the longest and shortest suffix n-gram looked
  up in the request's own tokens. Neither given: both 5; one given: the other takes its
  value; both >= 1 and min <= max.

A leaf module (standard library only), shared by the command line, the scheduler and the
runners.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

NGRAM_METHOD_SPELLINGS = frozenset({"ngram", "[ngram]", "ngram_gpu"})
DEFAULT_PROMPT_LOOKUP = 5
"""vLLM's default for both n-gram bounds when neither is given."""
_KNOWN_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
)


class SpeculativeConfigError(ValueError):
    """An invalid --speculative-config; the message names the key and the fix."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    """Always "ngram" (the spellings vLLM accepts are normalised)."""
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise SpeculativeConfigError(f"method must be 'ngram', got {self.method!r}")
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("prompt_lookup_min", self.prompt_lookup_min)
        _check_positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @property
    def max_tokens_per_decode_step(self) -> int:
        """Tokens one decode row runs when fully drafted: the last token plus K drafts."""
        return 1 + self.num_speculative_tokens


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The --speculative-config JSON string as a validated SpeculativeConfig."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpeculativeConfigError(
            f"--speculative-config is not valid JSON ({exc.msg} at character {exc.pos}); "
            """expected e.g. '{"method": "ngram", "num_speculative_tokens": 4}'"""
        ) from None
    if not isinstance(value, dict):
        raise SpeculativeConfigError(
            f"--speculative-config must be a JSON object, got {type(value).__name__}"
        )
    return speculative_config_from_dict(value)


def speculative_config_from_dict(fields: dict[str, Any]) -> SpeculativeConfig:
    unknown = sorted(set(fields) - set(_KNOWN_KEYS))
    if unknown:
        raise SpeculativeConfigError(
            f"--speculative-config: unsupported key(s) {', '.join(map(repr, unknown))}; "
            f"known keys: {', '.join(_KNOWN_KEYS)}"
        )
    method = _method(fields)
    num_tokens = fields.get("num_speculative_tokens")
    if num_tokens is None:
        raise SpeculativeConfigError(
            "--speculative-config: num_speculative_tokens is required for the ngram method"
        )
    lookup_min = _optional_int(fields, "prompt_lookup_min")
    lookup_max = _optional_int(fields, "prompt_lookup_max")
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
    elif lookup_min is None:
        lookup_min = lookup_max
    elif lookup_max is None:
        lookup_max = lookup_min
    assert lookup_min is not None and lookup_max is not None
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=_int(num_tokens, "num_speculative_tokens"),
        prompt_lookup_min=lookup_min,
        prompt_lookup_max=lookup_max,
    )


def _method(fields: dict[str, Any]) -> str:
    method, model = fields.get("method"), fields.get("model")
    if method is None and model in ("ngram", "[ngram]"):
        return "ngram"
    if model is not None and model not in ("ngram", "[ngram]"):
        raise SpeculativeConfigError(
            f"--speculative-config: draft models are not supported (model={model!r}); "
            "only prompt-lookup drafting: method 'ngram'"
        )
    if method not in NGRAM_METHOD_SPELLINGS:
        raise SpeculativeConfigError(
            f"--speculative-config: method {method!r} is not supported; tandem implements "
            "'ngram' (prompt lookup)"
        )
    return "ngram"


def _optional_int(fields: dict[str, Any], key: str) -> int | None:
    value = fields.get(key)
    return None if value is None else _int(value, key)


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(
            f"--speculative-config: {key} must be an integer, got {value!r}"
        )
    return value


def _check_positive(key: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpeculativeConfigError(
            f"--speculative-config: {key} must be an integer >= 1, got {value!r}"
        )
