"""Prompt embeddings as bytes: a client's tensor decoded and checked without unpickling
anything, so that the front end (no torch) and the offline API build the same message.

Two encodings are read, both plain data:

- a safetensors file holding exactly one tensor (any name; `__metadata__` allowed): an
  8-byte little-endian header length, a JSON header, then the tensor's bytes. The header is
  bounded (MAX_HEADER_BYTES) and every offset checked against the buffer before anything
  is allocated; a buffer with bytes no tensor covers is refused, as safetensors itself does;
- raw bytes with a dtype name and a shape (little-endian, row-major).

A pickle, a torch.save archive, or anything else is refused: loading a pickle runs code of
the sender's choosing. The shape is [num_tokens, hidden_size] ([1, num_tokens,
hidden_size] is read as that), the dtype float32, bfloat16 or float16, and every value
finite.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from actors.protocol.messages import PromptEmbeds

ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The dtypes a prompt's rows may come in, and their sizes."""
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
MAX_HEADER_BYTES = 1 << 16
"""A header of one tensor takes about 100 bytes; metadata may add some, not megabytes."""
_HEADER_LEN_BYTES = 8
_EXPONENT_MASKS = {"float32": 0x7F800000, "bfloat16": 0x7F80, "float16": 0x7C00}
"""An all-ones exponent is an infinity or a NaN."""
_UINT_VIEWS = {"float32": "<u4", "bfloat16": "<u2", "float16": "<u2"}


class PromptEmbedsError(ValueError):
    """The bytes are not prompt embeddings this server takes; the message says why."""


def max_encoded_bytes(max_num_tokens: int, hidden_size: int) -> int:
    """The most bytes a safetensors file or raw buffer of at most `max_num_tokens` float32
    rows takes: anything longer is refused before it is decoded."""
    return _HEADER_LEN_BYTES + MAX_HEADER_BYTES + max_num_tokens * hidden_size * 4


def from_safetensors(buffer: bytes) -> PromptEmbeds:
    """The one tensor of a safetensors file, as prompt embeddings (shape and values checked
    by `check_embeds`, which needs the model)."""
    _refuse_pickles(buffer)
    if len(buffer) < _HEADER_LEN_BYTES:
        raise PromptEmbedsError(f"{len(buffer)} bytes is too short for a safetensors file")
    header_len = int.from_bytes(buffer[:_HEADER_LEN_BYTES], "little")
    if not 2 <= header_len <= MAX_HEADER_BYTES:
        raise PromptEmbedsError(
            f"not a safetensors file of one tensor: its header would be {header_len} bytes "
            f"(at most {MAX_HEADER_BYTES})"
        )
    data_start = _HEADER_LEN_BYTES + header_len
    if data_start > len(buffer):
        raise PromptEmbedsError(
            f"the safetensors header runs past the end ({data_start} of {len(buffer)} bytes)"
        )
    name, entry = _single_tensor(buffer[_HEADER_LEN_BYTES:data_start])
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise PromptEmbedsError(
            f"tensor {name!r} is {entry['dtype']}; prompt embeddings must be F32, BF16 or F16"
        )
    begin, end = entry["data_offsets"]
    num_data_bytes = len(buffer) - data_start
    if begin != 0 or end != num_data_bytes:
        raise PromptEmbedsError(
            f"tensor {name!r} covers bytes [{begin}, {end}) of the {num_data_bytes} after the "
            "header; one tensor must cover them all"
        )
    return from_raw(buffer[data_start:], dtype, entry["shape"])


def from_raw(data: bytes, dtype: str, shape: Sequence[int]) -> PromptEmbeds:
    """Prompt embeddings from little-endian row-major bytes of `dtype` and `shape`."""
    if dtype not in ITEM_BYTES:
        raise PromptEmbedsError(
            f"dtype {dtype!r} is not one of {', '.join(ITEM_BYTES)} (prompt embeddings are "
            "floating point)"
        )
    dims = _dims(shape)
    if len(dims) == 3 and dims[0] == 1:
        dims = dims[1:]
    if len(dims) != 2:
        raise PromptEmbedsError(
            f"shape {list(shape)} is not [num_tokens, hidden_size] (nor [1, num_tokens, "
            "hidden_size])"
        )
    num_tokens, hidden_size = dims
    expected = num_tokens * hidden_size * ITEM_BYTES[dtype]
    if len(data) != expected:
        raise PromptEmbedsError(
            f"shape {list(shape)} of {dtype} takes {expected} bytes, but {len(data)} were given"
        )
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{dtype}:{num_tokens}x{hidden_size}:".encode())
    digest.update(data)
    return PromptEmbeds(bytes(data), dtype, num_tokens, hidden_size, digest.digest())


def check_embeds(embeds: PromptEmbeds, hidden_size: int, max_num_tokens: int) -> None:
    """Refuse rows the model cannot run: a width other than its hidden size, no rows, more
    rows than `max_num_tokens`, a NaN or an infinity."""
    if embeds.hidden_size != hidden_size:
        raise PromptEmbedsError(
            f"rows of {embeds.hidden_size} values do not fit this model, whose hidden size "
            f"is {hidden_size}"
        )
    if embeds.num_tokens == 0:
        raise PromptEmbedsError("there are no rows: a prompt needs at least one")
    if embeds.num_tokens > max_num_tokens:
        raise PromptEmbedsError(
            f"{embeds.num_tokens} rows are more than the {max_num_tokens} prompt tokens "
            "this model's context leaves room for"
        )
    bits = np.frombuffer(embeds.data, dtype=_UINT_VIEWS[embeds.dtype])
    mask = _EXPONENT_MASKS[embeds.dtype]
    if bool(((bits & mask) == mask).any()):
        raise PromptEmbedsError("the rows hold a NaN or an infinity")


def last_rows(embeds: PromptEmbeds, num_rows: int) -> PromptEmbeds:
    """The last `num_rows` rows (truncate_prompt_tokens), or `embeds` when it has no more."""
    if embeds.num_tokens <= num_rows:
        return embeds
    row_bytes = embeds.hidden_size * ITEM_BYTES[embeds.dtype]
    return from_raw(
        embeds.data[len(embeds.data) - num_rows * row_bytes :],
        embeds.dtype,
        (num_rows, embeds.hidden_size),
    )


def _refuse_pickles(buffer: bytes) -> None:
    if buffer[:4] == b"PK\x03\x04" or buffer[:1] == b"\x80":
        raise PromptEmbedsError(
            "this is a torch.save / pickle file, which this server never loads (unpickling "
            "runs code): send a safetensors file, e.g. base64 of "
            "safetensors.torch.save({'embeds': tensor})"
        )


def _single_tensor(header_bytes: bytes) -> tuple[str, dict[str, Any]]:
    try:
        header = json.loads(header_bytes.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise PromptEmbedsError("the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise PromptEmbedsError("the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise PromptEmbedsError("the safetensors __metadata__ is not an object")
    if len(header) != 1:
        raise PromptEmbedsError(
            f"the safetensors file holds {len(header)} tensors; prompt embeddings are one"
        )
    name, entry = next(iter(header.items()))
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("dtype"), str)
        or not isinstance(entry.get("shape"), list)
        or not _is_offset_pair(entry.get("data_offsets"))
    ):
        raise PromptEmbedsError(
            f"tensor {name!r}: a safetensors entry needs dtype, shape and data_offsets"
        )
    return name, entry


def _is_offset_pair(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _dims(shape: Sequence[Any]) -> list[int]:
    if len(shape) > 3 or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape
    ):
        raise PromptEmbedsError(f"shape {list(shape)} is not a list of up to 3 sizes")
    if math.prod(shape) == 0 and len(shape) >= 2 and shape[-1] == 0:
        raise PromptEmbedsError(f"shape {list(shape)} has rows of no values")
    return list(shape)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
