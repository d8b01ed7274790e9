"""Per-request sampling parameters, validated once when a request enters the engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from actors.protocol.structured_output import StructuredOutputSpec

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class SamplingParamsError(ValueError):
    """One invalid sampling parameter; `param` names it (OpenAI error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 or 0 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    max_tokens: int | None = 16
    """None: up to the context length."""
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the sampled token's logprob plus the top k."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: each prompt token's logprob (from the second on) plus the top k
    at its position, computed in the prefill (the request then reuses no cached prefix)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutputSpec | None = None
    """Constrain the output to a schema, regex, choice or grammar (the engine applies it as a
    token bitmask); None: unconstrained."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    extra_args: dict[str, Any] | None = field(default=None, hash=False)
    """Arguments for custom logits processors: the request's `vllm_xargs` (str -> str,
    int, float or a list of them), read by processors as `params.extra_args`."""

    def __post_init__(self) -> None:
        _check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(
            self.temperature >= 0.0,
            "temperature",
            f"temperature must be non-negative, got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        _check(
            self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        # Only the sign here: the most a request may ask for is the server's setting
        # (--max-logprobs), checked by the front end, and these parameters also travel to
        # the engine core, whose decoder runs this check and must accept what was admitted.
        _check(
            self.logprobs is None or self.logprobs >= 0,
            "logprobs",
            f"logprobs must be >= 0, got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "prompt_logprobs",
            f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}",
        )
        _check(
            self.seed is None or _SEED_MIN <= self.seed <= _SEED_MAX,
            "seed",
            f"seed must be a 64-bit integer, got {self.seed}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop strings must be non-empty strings",
        )
        for token_id, bias in self.logit_bias:
            _check(
                -100.0 <= bias <= 100.0,
                "logit_bias",
                f"logit_bias for token {token_id} must be in [-100, 100], got {bias}",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
