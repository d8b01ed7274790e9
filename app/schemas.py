"""Request bodies of the OpenAI-compatible API, as pydantic models.

Every model accepts unknown fields (clients send vendor extensions; the server logs and
ignores them). Sampling values are read as leniently as vLLM reads them
(app/lenient_types.py): an integral float or a string of digits fills an integer field, a
numeric string a number field, `1`/`"true"` a boolean one; a fractional `max_tokens` or a
word where a number belongs is still a 400 naming the field. Fields tandem knows but does
not implement yet are declared so that a non-default value can be refused with a 400
naming the field, never silently ignored.
These models also generate `/openapi.json`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.lenient_types import LenientBool, lenient_float, lenient_int

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
INT64_MAX = 2**63 - 1
"""Integers are bounded so that a huge one (JSON allows any) is a 400 naming its field."""
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
NumLogprobs = lenient_int(ge=0, le=INT64_MAX)
"""How many logprobs per token; the server's most (--max-logprobs) is checked later, by
actors/frontend/generation_defaults.py, so that one place decides."""

_MODEL_CONFIG = ConfigDict(extra="allow", strict=True)

NonNegativeInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""Token ids and counts that stay strict (a list of digit strings is a list of strings)."""
PositiveInt = lenient_int(ge=1, le=INT64_MAX)
XArgValue = str | int | float


class StreamOptions(BaseModel):
    model_config = _MODEL_CONFIG

    include_usage: LenientBool | None = None
    """Send a usage chunk (with `choices: []`) after the last choice finishes."""
    continuous_usage_stats: LenientBool | None = None
    """Put cumulative usage on every chunk (vLLM extension)."""


class TextContentPart(BaseModel):
    model_config = _MODEL_CONFIG

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _MODEL_CONFIG

    name: str
    arguments: str | dict[str, Any] | None = None
    """JSON text, as OpenAI sends it (an object is accepted too)."""


class ToolCall(BaseModel):
    """A call the assistant made earlier in the conversation."""

    model_config = _MODEL_CONFIG

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _MODEL_CONFIG

    role: str = Field(min_length=1)
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Assistant messages: the calls it made (content is then often null)."""
    tool_call_id: str | None = None
    """Tool messages: which call this result answers."""


class SamplingFields(BaseModel):
    """Sampling fields shared by chat and completions (OpenAI's plus vLLM's extras)."""

    model_config = _MODEL_CONFIG

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: lenient_float(ge=0.0) | None = None
    top_p: lenient_float(gt=0.0, le=1.0) | None = None
    n: PositiveInt | None = None
    stop: str | list[str] | None = None
    seed: lenient_int(ge=SEED_MIN, le=SEED_MAX) | None = None
    presence_penalty: lenient_float(ge=-2.0, le=2.0) | None = None
    frequency_penalty: lenient_float(ge=-2.0, le=2.0) | None = None
    logit_bias: dict[str, lenient_float(ge=-100.0, le=100.0)] | None = None
    stream: LenientBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extra sampling fields
    top_k: lenient_int(ge=-1, le=INT64_MAX) | None = None
    min_p: lenient_float(ge=0.0, le=1.0) | None = None
    repetition_penalty: lenient_float(gt=0.0, le=2.0) | None = None
    ignore_eos: LenientBool | None = None
    min_tokens: lenient_int(ge=0, le=INT64_MAX) | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    skip_special_tokens: LenientBool | None = None
    spaces_between_special_tokens: LenientBool | None = None
    include_stop_str_in_output: LenientBool | None = None
    truncate_prompt_tokens: lenient_int(ge=-1, le=INT64_MAX) | None = None
    priority: lenient_int(ge=PRIORITY_MIN, le=PRIORITY_MAX) | None = None
    """Lower runs first; only with priority scheduling on (--scheduling-policy priority)."""
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    return_token_ids: LenientBool | None = None
    vllm_xargs: dict[str, XArgValue | list[XArgValue]] | None = None
    """Per-request arguments for custom logits processors (--logits-processors), handed to
    them as `sampling_params.extra_args`."""
    prompt_logprobs: NumLogprobs | None = None
    """vLLM's: the prompt tokens' logprobs with the top k at each position."""
    # Known fields tandem does not implement yet: refused when set to a non-default value.
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logprob_token_ids: Any = None
    stream_interval: Any = None
    # Output constraints, turned into one spec by app/structured_outputs.py
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    truncation_side: Any = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    logprobs: LenientBool | None = False
    top_logprobs: NumLogprobs | None = None
    echo: LenientBool | None = False
    add_generation_prompt: LenientBool | None = True
    continue_final_message: LenientBool | None = False
    add_special_tokens: LenientBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    parallel_tool_calls: LenientBool | None = None
    store: LenientBool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    include_reasoning: LenientBool | None = None
    tools: Any = None
    """Function tools, checked by app/tool_calls/request.py."""
    tool_choice: Any = None
    # known, not implemented
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    documents: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None


TokenIds = list[NonNegativeInt]


class RawPromptEmbeds(BaseModel):
    """One prompt's embedding rows as raw bytes (app/prompt_embeds.py)."""

    model_config = _MODEL_CONFIG

    data: str
    """base64 of the little-endian, row-major values."""
    dtype: Literal["float32", "bfloat16", "float16"]
    shape: list[NonNegativeInt]
    """[num_tokens, hidden_size]."""


PromptEmbedsItem = str | RawPromptEmbeds
"""base64 of a safetensors file holding one tensor, or the raw form."""


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] | None = None
    """Required unless prompt_embeds is given."""
    prompt_embeds: PromptEmbedsItem | list[PromptEmbedsItem] | None = None
    """With --enable-prompt-embeds: prompts as embedding rows (app/prompt_embeds.py)."""
    max_tokens: PositiveInt | None = 16
    logprobs: NumLogprobs | None = None
    echo: LenientBool | None = False
    add_special_tokens: LenientBool | None = True
    # known, not implemented
    suffix: Any = None
    best_of: Any = None


class TokenizeRequest(BaseModel):
    """`prompt` (raw text) or `messages` (rendered through the chat template)."""

    model_config = _MODEL_CONFIG

    chat_template: Any = None
    """Refused when set: see REQUEST_TEMPLATE_REFUSED."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: LenientBool | None = None
    add_generation_prompt: LenientBool | None = True
    continue_final_message: LenientBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: LenientBool | None = False


class DetokenizeRequest(BaseModel):
    model_config = _MODEL_CONFIG

    model: str | None = None
    tokens: list[NonNegativeInt]


REQUEST_TEMPLATE_REFUSED = (
    "a chat template cannot come from a request; the server renders the model's own template"
)
"""A template is code run on the server: it is never taken from a request."""

_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    # field -> values that mean "not used" (always including None)
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "allowed_token_ids": ((),),
    "bad_words": ((),),
    "logprob_token_ids": ((),),
    "stream_interval": (1,),
    "truncation_side": ("left",),
    "spaces_between_special_tokens": (True,),
}
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "functions": (),
    "function_call": ("none",),
    "documents": (),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "best_of": (1,),
}


def unsupported_field(request: SamplingFields) -> tuple[str, str] | None:
    """The first known field whose requested behaviour tandem does not implement, as
    (field, message); None when every field is usable."""
    table = dict(_UNSUPPORTED_COMMON)
    table.update(
        _UNSUPPORTED_CHAT if isinstance(request, ChatCompletionRequest) else _UNSUPPORTED_COMPLETION
    )
    for name, unused_values in table.items():
        value = getattr(request, name)
        if value is None or _is_unused(value, unused_values):
            continue
        return name, f"'{name}' is not supported by this server yet"
    return _special_cases(request)


def _is_unused(value: Any, unused_values: tuple[Any, ...]) -> bool:
    if isinstance(value, list):
        value = tuple(value)
    return any(type(value) is type(u) and value == u for u in unused_values) or (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and any(
            isinstance(u, (int, float)) and not isinstance(u, bool) and value == u
            for u in unused_values
        )
    )


def _special_cases(request: SamplingFields) -> tuple[str, str] | None:
    if isinstance(request, ChatCompletionRequest):
        if request.chat_template is not None:
            return "chat_template", REQUEST_TEMPLATE_REFUSED
        if request.modalities is not None and list(request.modalities) != ["text"]:
            return "modalities", "only the 'text' modality is supported"
    if request.stream_options is not None and not request.stream:
        return "stream_options", "stream_options is only allowed when stream is true"
    return None


def known_field_names(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(model.model_fields)
