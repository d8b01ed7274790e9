"""Refusals decided by a request's size alone, made on the decoded JSON before the schema
validates it element by element and before any per-prompt or per-sample object exists.

A 62-byte request for n = 10**21 samples, or a body of millions of tiny prompts, must cost
microseconds to refuse, not minutes of building objects that are then refused. The
admission actor enforces the same limits on the engine requests it is given (for every
caller, not only HTTP); these checks only move the HTTP refusal before the work. A number is
checked as the schema will read it (app.lenient_types: `1e6` and `"1000000"` are the
integer 1000000); a value of the wrong type is left to the schema, which names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actors.frontend.admission import AdmissionLimits
from app.errors import bad_request, context_length_error
from app.lenient_types import int_as_read

MAX_VLLM_XARGS = 256
"""Most entries in a request's vllm_xargs (each is an argument for a logits processor)."""


def check_generation_size(
    data: Mapping[str, Any],
    limits: AdmissionLimits,
    *,
    max_model_len: int,
    vocab_size: int,
    completions: bool,
) -> None:
    """400 when a chat or completions request asks for more than the server takes: n,
    prompts x n (at most what the server holds at once, running and queued), token-list
    prompts that cannot fit the context, and the sizes of stop, logit_bias, vllm_xargs and
    stop_token_ids."""
    n = _int_or(data.get("n"), 1)
    if n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n}, got {n}", "n")
    prompts = _prompts(data.get("prompt")) if completions else []
    if completions:
        num_prompts = len(prompts) + _num_embeds_prompts(data.get("prompt_embeds"))
    else:
        num_prompts = 0
    num_sequences = max(num_prompts, 1) * max(n, 1)
    capacity = limits.max_num_running + limits.max_queued_requests
    if num_sequences > capacity:
        raise bad_request(
            f"this request needs {num_sequences} sequences ({num_prompts} "
            f"prompts x n = {n}); the server holds at most {capacity} at once",
            "n",
        )
    keep = _num_tokens_kept(data, max_model_len)
    for prompt in prompts:
        if isinstance(prompt, list):
            num_kept = len(prompt) if keep is None else min(len(prompt), keep)
            if num_kept >= max_model_len:
                raise context_length_error(num_kept, max_model_len)
    _check_count(data, "stop", limits.max_stop_strings, "stop strings")
    _check_count(data, "logit_bias", limits.max_logit_bias_entries, "logit_bias entries")
    _check_count(data, "stop_token_ids", vocab_size, "stop token ids")
    _check_count(data, "vllm_xargs", MAX_VLLM_XARGS, "vllm_xargs entries")


def drop_truncated_tokens(data: dict[str, Any], max_model_len: int) -> None:
    """Cut token-list prompts to what truncate_prompt_tokens keeps before anything validates
    them: a client may send any number of ids to keep the last few, and validating them all
    is one long call. (Text prompts are cut once tokenized.)"""
    keep = _num_tokens_kept(data, max_model_len)
    prompt = data.get("prompt")
    if keep is None or not isinstance(prompt, list):
        return
    if _is_token_list(prompt):
        if len(prompt) > keep:
            data["prompt"] = prompt[-keep:]
    else:
        data["prompt"] = [p[-keep:] if isinstance(p, list) and len(p) > keep else p for p in prompt]


def check_priority(priority: int | None, enabled: bool) -> None:
    """A request may set a priority only where priority scheduling is on (otherwise every
    client could put itself first)."""
    if priority and not enabled:
        raise bad_request(
            "priority scheduling is not enabled on this server (it is, with "
            "--scheduling-policy priority); leave 'priority' unset or 0",
            "priority",
        )


def _prompts(prompt: Any) -> list[Any]:
    """The prompts of a completions request's `prompt` (none for a chat request)."""
    if prompt is None:
        return []
    if not isinstance(prompt, list) or _is_token_list(prompt):
        return [prompt]
    return prompt


def _num_embeds_prompts(prompt_embeds: Any) -> int:
    if prompt_embeds is None:
        return 0
    return len(prompt_embeds) if isinstance(prompt_embeds, list) else 1


def _is_token_list(prompt: list[Any]) -> bool:
    """One prompt of token ids (by its first item), rather than a list of prompts."""
    return bool(prompt) and isinstance(prompt[0], int) and not isinstance(prompt[0], bool)


def num_tokens_kept(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps: -1 as many as the
    context leaves room for; None (unset, 0) all of them."""
    if truncate_prompt_tokens == -1:
        return max_model_len - 1
    if truncate_prompt_tokens is None or truncate_prompt_tokens <= 0:
        return None
    return truncate_prompt_tokens


def _num_tokens_kept(data: Mapping[str, Any], max_model_len: int) -> int | None:
    return num_tokens_kept(int_as_read(data.get("truncate_prompt_tokens")), max_model_len)


def _int_or(value: Any, default: int) -> int:
    """`value` as the schema reads an integer; `default` where it reads none."""
    read = int_as_read(value)
    return default if read is None else read


def _check_count(data: Mapping[str, Any], field: str, limit: int, what: str) -> None:
    value = data.get(field)
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise bad_request(f"at most {limit} {what} are allowed, got {len(value)}", field)
