"""Prompt embeddings in the runners: each request's rows kept on the host, and per step the
rows its prefill chunk covers, placed where the model would look its (placeholder) token
ids up.

Both runners build a step's `EmbedsOverlay` with their other inputs and hand it to the
model's forward, which writes the rows over the looked-up embeddings
(gpu/models/llama.py). Positions past the prompt (generated tokens, after a preemption too)
are ordinary token ids. The V2 runner runs a step holding such rows without its CUDA
graphs (the graphs read token ids only); steps without them are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from actors.protocol.messages import PromptEmbeds
from actors.protocol.prompt_embeds import from_raw

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


class EmbedsOverlay(NamedTuple):
    token_index: torch.Tensor  # [num_rows] int64: positions in the step's flat token batch
    rows: torch.Tensor  # [num_rows, hidden_size] in the model dtype


def embeds_tensor(embeds: PromptEmbeds, dtype: torch.dtype) -> torch.Tensor:
    """[num_tokens, hidden_size] `dtype` on the host: the message's rows."""
    rows = torch.frombuffer(bytearray(embeds.data), dtype=_TORCH_DTYPES[embeds.dtype])
    return rows.view(embeds.num_tokens, embeds.hidden_size).to(dtype)


def embeds_from_tensor(tensor: Any) -> PromptEmbeds:
    """A torch tensor [num_tokens, hidden_size] (or [1, num_tokens, hidden_size]) as the
    message (the offline API's `{"prompt_embeds": tensor}`); raises PromptEmbedsError
    for a dtype or shape the engine does not take."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"prompt_embeds must be a torch.Tensor, got {type(tensor).__name__}")
    host = tensor.detach().to("cpu").contiguous()
    name = _NAMES.get(host.dtype, str(host.dtype).removeprefix("torch."))
    data = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return from_raw(data, name, tuple(host.shape))


def step_overlay(
    rows: Sequence[torch.Tensor | None],  # per scheduled request: [prompt_len, hidden] or None
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    device: torch.device,
) -> EmbedsOverlay | None:
    """The rows a step's chunks cover (request i runs positions num_computed_tokens[i] ..
    + num_scheduled_tokens[i]); None when no chunk covers any."""
    index_parts: list[np.ndarray] = []
    row_parts: list[torch.Tensor] = []
    offset = 0
    for request_rows, start, num in zip(rows, num_computed_tokens, num_scheduled_tokens):
        if request_rows is not None and start < request_rows.shape[0]:
            end = min(start + num, request_rows.shape[0])
            index_parts.append(np.arange(offset, offset + end - start, dtype=np.int64))
            row_parts.append(request_rows[start:end])
        offset += num
    if not row_parts:
        return None
    index = torch.from_numpy(np.concatenate(index_parts))
    stacked = torch.cat(row_parts)
    if device.type == "cuda":
        # From pinned memory, the copies do not wait; the host allocator keeps the staging
        # memory until they have run.
        index, stacked = index.pin_memory(), stacked.pin_memory()
    return EmbedsOverlay(index.to(device, non_blocking=True), stacked.to(device, non_blocking=True))


class RequestEmbeds:
    """The V2 runner's rows per request, from admission (or resumption) to its end."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self._rows: dict[str, torch.Tensor] = {}

    def add(self, request_id: str, embeds: PromptEmbeds | None) -> None:
        if embeds is not None:
            self._rows[request_id] = embeds_tensor(embeds, self.dtype)

    def remove(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def overlay(
        self,
        request_ids: Sequence[str],
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Sequence[int],
    ) -> EmbedsOverlay | None:
        if not self._rows:  # the common step: no request of the batch has rows
            return None
        rows = [self._rows.get(r) for r in request_ids]
        return step_overlay(rows, num_computed_tokens, num_scheduled_tokens, self.device)
