"""Prompt logprobs in responses: completions `echo` with `logprobs` (the legacy format over
prompt and output tokens, what lm-eval's loglikelihood reads) and vLLM's `prompt_logprobs`
field (chat and completions).

    prompt_logprobs: [null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]

One entry per prompt token; the first is null (nothing precedes it). Each entry holds the
prompt token and the top `prompt_logprobs` tokens at that position, as vLLM's does.

Streamed, they ride on each completions choice's first chunk (with the echoed prompt, before
any generated text) and on a chat stream's first chunk (once), so the chunks put together
equal the response that is not streamed.

A response holds every prompt token's top-k entries for every choice, built as Python
objects and encoded on the event loop: a request whose total would pass
MAX_PROMPT_LOGPROB_ENTRIES is refused before the engine sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.frontend.output_stream import LogprobEntry
from actors.protocol.sampling_params import SamplingParams
from app.errors import bad_request
from app.responses import completion_logprobs, floor_logprob

MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19
"""Most prompt logprob entries (prompt tokens x choices carrying them x (k + 1)) one
response may hold: about 200 MiB of response objects, a 32k-token prompt with the top 15,
or 64 prompts of 2k tokens with the top 3."""


def with_prompt_logprobs(params: SamplingParams, echo: bool) -> SamplingParams:
    """Completions echo + logprobs k needs the prompt's logprobs with the top k too."""
    if echo and params.logprobs is not None:
        params = params.replace(prompt_logprobs=max(params.prompt_logprobs or 0, params.logprobs))
    return params


def check_num_entries(
    params: SamplingParams, prompt_lens: Sequence[int], choices_per_prompt: int, param: str
) -> None:
    """400 naming `param` when the response's prompt logprobs would pass
    MAX_PROMPT_LOGPROB_ENTRIES (`choices_per_prompt`: how many choices carry each prompt's;
    a chat response carries them once)."""
    if params.prompt_logprobs is None:
        return
    num_tokens = sum(prompt_lens)
    num_entries = num_tokens * choices_per_prompt * (params.prompt_logprobs + 1)
    if num_entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise bad_request(
            f"{param}: the prompt logprobs asked for ({num_tokens} prompt tokens x "
            f"{choices_per_prompt} choices x {params.prompt_logprobs + 1} entries = "
            f"{num_entries}) are more than the server returns in one response "
            f"({MAX_PROMPT_LOGPROB_ENTRIES}); ask for fewer prompts, choices or logprobs",
            param,
        )


def vllm_prompt_logprobs(
    entries: Sequence[LogprobEntry | None] | None,
) -> list[dict[str, Any] | None] | None:
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {
            str(entry.token_id): {
                "logprob": floor_logprob(entry.logprob),
                "rank": entry.rank,
                "decoded_token": entry.token,
            }
        }
        for rank, top in enumerate(entry.top_logprobs, start=1):
            ranked.setdefault(
                str(top.token_id),
                {"logprob": floor_logprob(top.logprob), "rank": rank, "decoded_token": top.token},
            )
        out.append(ranked)
    return out


def echo_completion_logprobs(
    prompt_entries: Sequence[LogprobEntry | None],
    first_token_text: str,
    output_entries: Sequence[LogprobEntry] | None,
) -> dict[str, Any]:
    """The legacy logprobs of prompt then output tokens; the first prompt token has no
    logprob (null), as OpenAI's echo returns it."""
    scored = [e for e in prompt_entries[1:] if e is not None] + list(output_entries or ())
    body = completion_logprobs(scored, len(first_token_text))
    assert body is not None
    return {
        "tokens": [first_token_text, *body["tokens"]],
        "token_logprobs": [None, *body["token_logprobs"]],
        "top_logprobs": [None, *body["top_logprobs"]],
        "text_offset": [0, *body["text_offset"]],
    }


def add_to_completion(
    body: dict[str, Any], choices: Sequence[Any], echo_first_tokens: Sequence[str] | None
) -> None:
    """Put each choice's prompt logprobs into a text_completion body (`choices`: the
    ChoiceStates, in body order; `echo_first_tokens`: each prompt's first token when the
    request asked for echo with logprobs)."""
    for body_choice, choice in zip(body["choices"], choices):
        if choice.prompt_logprobs is None:
            continue
        body_choice["prompt_logprobs"] = vllm_prompt_logprobs(choice.prompt_logprobs)
        if echo_first_tokens is not None:
            body_choice["logprobs"] = echo_completion_logprobs(
                choice.prompt_logprobs, echo_first_tokens[choice.prompt_index], choice.logprobs
            )


def add_to_chat(body: dict[str, Any], choices: Sequence[Any]) -> None:
    """vLLM's chat response carries the prompt's logprobs once, beside the choices."""
    if choices and choices[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs)
