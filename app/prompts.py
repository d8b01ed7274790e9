"""From a validated request to engine requests: chat template, tokenization, context-length
checks and sampling parameters. For a large body the routes run these in a worker thread
(see app.http_input.prepare_request)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actors.frontend.admission import child_sampling_params
from actors.frontend.generation_defaults import RequestDefaults, resolve_sampling_params
from actors.protocol.logits_processors import validate_request_params
from actors.protocol.messages import EngineRequest, PromptEmbeds
from actors.protocol.sampling_params import SamplingParams, SamplingParamsError
from app.chat_template import ChatTemplateError, RenderedTooLong, RenderLimit, normalize_messages
from app.errors import bad_request, context_length_error, text_too_long_error
from app.large_body import release_gradually
from app.prompt_bounds import chars_per_token, text_cannot_fit, truncation_start
from app.prompt_embeds import placeholder_token_ids, request_embeds
from app.request_limits import num_tokens_kept
from app.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from app.server_state import ServerState

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "template", "messages", "add_generation_prompt", "self"}
)
_PROMPT_FIELDS = frozenset({"messages", "prompt", "prompt_embeds"})
"""Left out, with unknown fields, when the sampling fields are read (they may be large)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: tuple[int, ...]
    text: str | None
    """The prompt text when the client sent text (echo needs it)."""
    embeds: PromptEmbeds | None = None
    """A prompt given as embedding rows; token_ids are then placeholders."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    prompt: Prompt
    role: str
    """Role of the reply: assistant, or the last message's when it is continued."""
    echo_prefix: str


def require_tokenizer(state: ServerState, param: str) -> Any:
    """The server's tokenizer, or a 400 that says there is none (dummy weights served
    without --tokenizer take and return token ids only)."""
    if state.tokenizer is None:
        raise bad_request(
            "this model is served without a tokenizer, so it takes and returns "
            "token ids only: send 'prompt' as a list of token ids to "
            "/v1/completions, or start the server with --tokenizer",
            param,
        )
    return state.tokenizer


def chat_prompt(
    state: ServerState, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
) -> ChatPrompt:
    """The rendered and tokenized conversation. `tools` (OpenAI's shape) reach the template
    as its `tools` variable, as in transformers; a template that does not use them renders
    without them."""
    tokenizer = require_tokenizer(state, "messages")
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false",
            "continue_final_message",
        )
    kwargs = template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if tools:
        kwargs.setdefault("tools", tools)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    limit = state.max_model_len - 1
    # A conversation cut to its last tokens is rendered whole (its end is what is kept); a
    # continued final message is cut after rendering.
    cut_to = _num_tokens_cut_to(req.truncate_prompt_tokens, state.max_model_len)
    render_limit = (
        None
        if cut_to is not None or req.continue_final_message
        else _render_limit(tokenizer, limit)
    )
    try:
        last = normalize_messages(messages[-1:], first_index=len(messages) - 1)[0]
        text = _render(
            tokenizer,
            messages,
            bool(req.add_generation_prompt),
            bool(req.continue_final_message),
            kwargs,
            render_limit,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    except RenderedTooLong as exc:
        raise text_too_long_error(exc.num_chars, limit, state.max_model_len) from None
    finally:
        release_gradually(messages)
    token_ids = encode_prompt(
        tokenizer,
        text,
        bool(req.add_special_tokens),
        req.truncate_prompt_tokens,
        state.max_model_len,
    )
    role = "assistant" if req.add_generation_prompt else req.messages[-1].role
    echo_prefix = ""
    if req.echo and last.get("role") == role and isinstance(last.get("content"), str):
        echo_prefix = last["content"]
    return ChatPrompt(Prompt(tuple(token_ids), text), role, echo_prefix)


def template_kwargs(requested: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, which become template variables. Names that would
    replace the template or a fixed argument of the renderer are refused with a 400 (a
    template is never taken from a request)."""
    kwargs = dict(requested or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs cannot set {reserved[0]!r}: the chat template "
            "and the renderer's own arguments are the server's",
            "chat_template_kwargs",
        )
    return kwargs


def _render_limit(tokenizer: Any, max_num_tokens: int) -> RenderLimit | None:
    """Where rendering may stop: text that long (the prompt bound's characters per token)
    cannot fit. A continued final message cuts the text after rendering, so it gets none."""
    bound = chars_per_token(tokenizer)
    return None if bound is None else RenderLimit(max_num_tokens * bound.max_chars, bound.dropped)


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final: bool,
    kwargs: dict[str, Any],
    limit: RenderLimit | None,
) -> str:
    text: str = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, limit=limit, **kwargs
    )
    if not continue_final:
        return text
    # The template closes the final message; continuing it means cutting right after its text.
    final = normalize_messages(messages[-1:])[0].get("content") or ""
    cut = text.rfind(final) if final else -1
    if cut < 0:
        raise ChatTemplateError(
            "continue_final_message: the final message's text does not "
            "appear in the rendered prompt"
        )
    return text[: cut + len(final)]


def encode_prompt(
    tokenizer: Any,
    text: str,
    add_special_tokens: bool,
    truncate_prompt_tokens: int | None,
    max_model_len: int,
) -> list[int]:
    """The token ids of prompt `text`, of which truncate_and_check keeps the last k when
    truncate_prompt_tokens sets a k below the context length: then only a tail of the text
    long enough for those k is tokenized (app.prompt_bounds.truncation_start), so its size,
    not the text's, is the cost. Otherwise text that surely has more tokens than the context
    holds is refused before it is tokenized."""
    cut_to = _num_tokens_cut_to(truncate_prompt_tokens, max_model_len)
    if cut_to is None:
        return encode_checked(tokenizer, text, add_special_tokens, max_model_len - 1, max_model_len)
    tail = text[truncation_start(text, tokenizer, cut_to) :]
    ids: list[int] = tokenizer.encode(tail, add_special_tokens)
    return ids


def _num_tokens_cut_to(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """The k of truncate_prompt_tokens where it can make a prompt too long for the context
    fit; None where it cannot (unset, or keeping no fewer tokens than the context holds: a
    prompt too long stays too long, and is refused as without it)."""
    num_kept = num_tokens_kept(truncate_prompt_tokens, max_model_len)
    return num_kept if num_kept is not None and num_kept < max_model_len else None


def encode_checked(
    tokenizer: Any,
    text: str,
    add_special_tokens: bool,
    max_num_tokens: int | None,
    max_model_len: int,
) -> list[int]:
    """`text`'s token ids; text that surely has more than `max_num_tokens` tokens (None:
    no limit) is refused before it is tokenized."""
    if max_num_tokens is not None and text_cannot_fit(text, tokenizer, max_num_tokens):
        raise text_too_long_error(len(text), max_num_tokens, max_model_len)
    ids: list[int] = tokenizer.encode(text, add_special_tokens)
    return ids


def completion_prompts(state: ServerState, req: CompletionRequest) -> list[Prompt]:
    """The prompts, tokenized, truncated and checked against the context: those given as
    embeddings first (as vLLM orders them), then those of `prompt`."""
    embedded = [Prompt(placeholder_token_ids(e), None, e) for e in request_embeds(state, req)]
    raw = req.prompt
    if embedded and raw in ("", []):  # clients that must send a prompt send an empty one
        raw = None
    if raw is None:
        if not embedded:
            raise bad_request("prompt is required (or prompt_embeds)", "prompt")
        return embedded
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    max_model_len, vocab_size = state.max_model_len, state.vocab_size
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = encode_prompt(
                require_tokenizer(state, "prompt"),
                item,
                bool(req.add_special_tokens),
                req.truncate_prompt_tokens,
                max_model_len,
            )
            prompt = Prompt(tuple(ids), item)
        else:
            if item and max(item) >= vocab_size:
                bad = next(t for t in item if t >= vocab_size)
                raise bad_request(
                    f"prompt {i}: token id {bad} is outside the vocabulary [0, {vocab_size})",
                    "prompt",
                )
            prompt = Prompt(tuple(item), None)
        if not prompt.token_ids:
            raise bad_request(f"prompt {i} is empty", "prompt")
        prompts.append(truncate_and_check(prompt, req.truncate_prompt_tokens, max_model_len))
    return embedded + prompts


def truncate_and_check(prompt: Prompt, truncate_to: int | None, max_model_len: int) -> Prompt:
    """Apply truncate_prompt_tokens (keep the last k; -1 = the context length), then refuse
    a prompt that leaves no room for output."""
    keep = num_tokens_kept(truncate_to, max_model_len)
    if keep is not None and len(prompt.token_ids) > keep:
        prompt = Prompt(prompt.token_ids[-keep:], None)
    if len(prompt.token_ids) >= max_model_len:
        raise context_length_error(len(prompt.token_ids), max_model_len)
    return prompt


def sampling_params(
    state: ServerState, req: SamplingFields, prompt_lens: Sequence[int]
) -> SamplingParams:
    """SamplingParams with the model's defaults; max_tokens checked against the context of
    the longest prompt (refused, or clamped with --clamp-max-tokens)."""
    is_chat = isinstance(req, ChatCompletionRequest)
    fields = req.model_dump(exclude_none=True, exclude=_PROMPT_FIELDS.union(req.model_extra or ()))
    requested = req.max_completion_tokens if is_chat else None
    requested_name = "max_completion_tokens" if requested is not None else "max_tokens"
    if requested is None:
        requested = req.max_tokens
    defaults = RequestDefaults(
        vocab_size=state.vocab_size,
        max_tokens=None if is_chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
        max_logprobs=state.settings.engine.max_logprobs,
    )
    try:
        params = resolve_sampling_params(fields, state.generation_config, defaults)
        validate_request_params(state.settings.engine.logits_processors, params)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), exc.param) from None
    room = state.max_model_len - max(prompt_lens)
    max_tokens = requested if requested is not None else params.max_tokens
    if max_tokens is not None and max_tokens > room:
        if requested is not None and not state.settings.clamp_max_tokens:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {state.max_model_len} tokens and your "
                f"request has {max(prompt_lens)} input tokens ({max_tokens} > "
                f"{state.max_model_len} - {max(prompt_lens)}).",
                requested_name,
            )
        max_tokens = room
    try:
        return params.replace(max_tokens=max_tokens)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), exc.param) from None


def engine_requests(
    base_id: str,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    state: ServerState,
    req: SamplingFields,
    arrival_time: float,
) -> list[EngineRequest]:
    """One engine request per (prompt, sample), in choice-index order: prompt-major.
    `arrival_time` is time.monotonic() when the HTTP request arrived (before tokenization,
    as vLLM measures time to first token)."""
    out = []
    for p_index, prompt in enumerate(prompts):
        for sample in range(params.n):
            out.append(
                EngineRequest(
                    request_id=f"{base_id}-{p_index}-{sample}",
                    prompt_token_ids=prompt.token_ids,
                    sampling_params=child_sampling_params(params, sample),
                    arrival_time=arrival_time,
                    eos_token_ids=state.eos_token_ids,
                    priority=req.priority or 0,
                    cache_salt=req.cache_salt,
                    prompt_embeds=prompt.embeds,
                )
            )
    return out
