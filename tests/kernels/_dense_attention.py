"""An independent reference for windowed attention with sinks: the full masked score
matrix over one request's contiguous K/V history, masked by transformers' own mask
functions and normalised by transformers' gpt-oss `eager_attention_forward` (logits
concatenated with the sink column, max-subtracted, softmax, sink column dropped)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def dense_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim], the last query_len positions
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim], positions 0..seq_len - 1
    values: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]; None: a sink of -inf (no sink)
) -> torch.Tensor:  # [query_len, num_heads, head_dim] float64
    # imported here: interpreted kernel checks load this module in a fresh process
    from transformers.masking_utils import (
        causal_mask_function,
        sliding_window_causal_mask_function,
    )
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    mask_function = (
        causal_mask_function
        if sliding_window is None
        else sliding_window_causal_mask_function(sliding_window)
    )
    q_idx = torch.arange(seq_len - query_len, seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    allowed = mask_function(0, 0, q_idx, kv_idx)  # [query_len, seq_len] bool
    additive_mask = torch.zeros(allowed.shape, dtype=torch.float64)
    additive_mask.masked_fill_(~allowed, float("-inf"))
    if sinks is None:
        sinks = torch.full((num_heads,), float("-inf"))
    module = SimpleNamespace(
        num_key_value_groups=num_heads // num_kv_heads,
        sinks=sinks.double().cpu(),
        training=False,
    )
    out, _ = eager_attention_forward(
        module,
        query.double().cpu().transpose(0, 1)[None],
        keys.double().cpu().transpose(0, 1)[None],
        values.double().cpu().transpose(0, 1)[None],
        additive_mask[None, None],
        scaling=scale,
    )
    return out[0]  # eager_attention_forward returns [batch, query_len, num_heads, head_dim]
