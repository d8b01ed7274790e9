"""Random fixed-length requests for `tandem bench serve`: token-id prompts for
/v1/completions (exactly `input_len` tokens, no tokenizer needed on the client) and
random-word prompts for /v1/chat/completions: about `input_len` words, or, with a
tokenizer (`--tokenizer`, as the server's), exactly `input_len` tokens of message text."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

DEFAULT_TOKEN_ID_RANGE = (1000, 32000)
"""Ordinary vocabulary of every supported tokenizer: above Llama 2's byte tokens and
SmolLM2's specials, below Llama 2's vocabulary size and Llama 3's / Qwen's specials."""

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river light green small large early young important public bad able blue"
)
_WORDS = tuple(_WORD_TEXT.split())

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class Workload:
    endpoint: str
    num_prompts: int
    input_len: int
    output_len: int
    ignore_eos: bool
    temperature: float
    seed: int
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE
    tokenizer: str | None = None
    """A tokenizer.json or Hugging Face directory that sizes chat prompts in tokens."""
    response_format: dict[str, Any] | None = None
    """Sent as every request's response_format (structured outputs)."""


def token_id_prompts(num_prompts: int, input_len: int, seed: int,
                     token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE) -> list[list[int]]:
    """`num_prompts` lists of `input_len` token ids drawn uniformly from [low, high)."""
    low, high = token_id_range
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num_prompts)]


def text_prompts(num_prompts: int, input_len: int, seed: int, tokenizer: Any = None
                 ) -> list[str]:
    """Sentences of `input_len` random common words (roughly one token each); with a
    tokenizer, cut to exactly `input_len` tokens (each word is one or more whole tokens,
    so the cut text encodes back to the same length)."""
    rng = random.Random(seed)
    num_words = input_len if tokenizer is None else 2 * input_len
    texts = [" ".join(rng.choice(_WORDS) for _ in range(num_words)) for _ in range(num_prompts)]
    if tokenizer is None:
        return texts
    return [tokenizer.decode(tokenizer.encode(text)[:input_len]) for text in texts]


def prompts_for(workload: Workload, seed: int, num_prompts: int | None = None) -> list[Any]:
    count = workload.num_prompts if num_prompts is None else num_prompts
    if workload.endpoint == "completions":
        return token_id_prompts(count, workload.input_len, seed, workload.token_id_range)
    tokenizer = None
    if workload.tokenizer is not None:
        from app.tokenizer_loader import load_tokenizer

        tokenizer = load_tokenizer(workload.tokenizer)
    return text_prompts(count, workload.input_len, seed, tokenizer)


def request_body(workload: Workload, prompt: Any, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": workload.temperature}
    if workload.endpoint == "completions":
        body.update(prompt=prompt, max_tokens=workload.output_len)
    else:
        body.update(messages=[{"role": "user", "content": prompt}],
                    max_completion_tokens=workload.output_len)
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if workload.response_format is not None:
        body["response_format"] = workload.response_format
    return body


def prompts_digest(prompts: list[Any]) -> str:
    """A short fingerprint, so two results can show they ran the same prompts."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
