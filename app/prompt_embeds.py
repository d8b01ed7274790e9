"""`prompt_embeds` of /v1/completions: the prompt as embedding rows instead of text.

As vLLM takes it (with --enable-prompt-embeds): base64 of a serialised tensor
[num_tokens, hidden_size], or a list of those (one prompt each; they come before the
`prompt` entries of the same request, whose choices follow). Where vLLM reads the bytes
with torch.load (an unpickler, which runs code of the sender's choosing), tandem reads
only plain data (actors/protocol/prompt_embeds.py): base64 of a safetensors file holding
one tensor, or an object {"data": base64 of the raw little-endian bytes, "dtype":
"float32" | "bfloat16" | "float16", "shape": [num_tokens, hidden_size]}. Anything else,
a width other than the model's hidden size, no rows, more rows than the context leaves
room for, a NaN or an infinity is a 400 naming `prompt_embeds`; an item longer than the
longest prompt could take is refused before it is decoded.
"""

from __future__ import annotations

import base64
import binascii

from actors.protocol.messages import PromptEmbeds
from actors.protocol.prompt_embeds import (
    PromptEmbedsError,
    check_embeds,
    from_raw,
    from_safetensors,
    last_rows,
    max_encoded_bytes,
)
from app.errors import bad_request
from app.request_limits import num_tokens_kept
from app.schemas import CompletionRequest, RawPromptEmbeds
from app.server_state import ServerState

PARAM = "prompt_embeds"
PLACEHOLDER_TOKEN_ID = 0
"""The token id of every prompt position given as a row (never looked up)."""
DISABLED_MESSAGE = (
    "prompt_embeds are not accepted by this server: start it with --enable-prompt-embeds"
)


def placeholder_token_ids(embeds: PromptEmbeds) -> tuple[int, ...]:
    return (PLACEHOLDER_TOKEN_ID,) * embeds.num_tokens


def request_embeds(state: ServerState, req: CompletionRequest) -> list[PromptEmbeds]:
    """The request's prompt embeddings, decoded and checked against the model (none when
    the field is unset); 400 naming `prompt_embeds` for anything the engine cannot run."""
    value = req.prompt_embeds
    if value is None:
        return []
    if not state.settings.engine.enable_prompt_embeds:
        raise bad_request(DISABLED_MESSAGE, PARAM)
    if req.echo:
        raise bad_request("echo is not supported with prompt_embeds (they have no text)", "echo")
    if req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs are not supported with prompt_embeds (their positions have no "
            "token to score)",
            "prompt_logprobs",
        )
    items = value if isinstance(value, list) else [value]
    if not items:
        raise bad_request("prompt_embeds must not be an empty list", PARAM)
    assert state.engine_info is not None  # set before the server serves
    hidden_size = state.engine_info.hidden_size
    max_num_tokens = state.max_model_len - 1
    keep = num_tokens_kept(req.truncate_prompt_tokens, state.max_model_len)
    out = []
    for index, item in enumerate(items):
        where = PARAM if len(items) == 1 and not isinstance(value, list) else f"{PARAM}[{index}]"
        try:
            embeds = _decode(item, max_encoded_bytes(max_num_tokens, hidden_size))
            if keep is not None:
                embeds = last_rows(embeds, keep)
            check_embeds(embeds, hidden_size, max_num_tokens)
        except PromptEmbedsError as exc:
            raise bad_request(f"{where}: {exc}", PARAM) from None
        out.append(embeds)
    return out


def _decode(item: str | RawPromptEmbeds, max_bytes: int) -> PromptEmbeds:
    if isinstance(item, str):
        return from_safetensors(_base64(item, max_bytes, "the safetensors file"))
    return from_raw(_base64(item.data, max_bytes, "data"), item.dtype, item.shape)


def _base64(text: str, max_bytes: int, what: str) -> bytes:
    # Checked on the encoded length, before a byte is decoded.
    if len(text) > 4 * (max_bytes // 3 + 1):
        raise PromptEmbedsError(
            f"{what} is {len(text)} base64 characters; the longest prompt this model takes "
            f"needs at most {4 * (max_bytes // 3 + 1)}"
        )
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise PromptEmbedsError(f"{what} is not standard base64") from None
