"""The decoder's token-wise math as plain functions of tensors, for torch.compile.

gpu/models runs these ops as fused Triton kernels (kernels/rms_norm.py, qkv_prologue.py,
silu_mul.py); inductor would see those as opaque calls, so the compiled V1 path traces the
kernels' torch references instead, written here without their argument checks (a check on
the unbacked token dimension would stop a full-graph trace). The arithmetic is the
references', so a compiled step computes what an eager one does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.qkv_prologue import apply_rotary_ref as apply_rotary


class HeadShape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., dim] -> [..., dim]: RMSNorm in float32, cast back, then scaled by `weight` [dim]."""
    x_fp32 = x.float()
    inv_rms = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x_fp32 * inv_rms).to(x.dtype)


def rotary_cos_sin(
    cos_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    positions: torch.Tensor,  # [num_tokens] int64
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, 1, head_dim // 2] dtype
    cos = cos_cache.index_select(0, positions).to(dtype)
    sin = sin_cache.index_select(0, positions).to(dtype)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def project_qkv(
    normed: torch.Tensor,  # [num_tokens, hidden_size]
    qkv_proj: torch.Tensor,  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden_size]
    qkv_bias: torch.Tensor | None,  # [(num_heads + 2 * num_kv_heads) * head_dim]
    q_norm_weight: torch.Tensor | None,  # [head_dim] (Qwen3 q/k norm)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    shape: HeadShape,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim],
    q and k normed (if the model norms them) and rotated."""
    num_tokens = normed.shape[0]
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    qkv = F.linear(normed, qkv_proj, qkv_bias)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query = query.view(num_tokens, shape.num_heads, shape.head_dim)
    key = key.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    value = value.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    if q_norm_weight is not None and k_norm_weight is not None:
        query = rms_norm(query, q_norm_weight, norm_eps)
        key = rms_norm(key, k_norm_weight, norm_eps)
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value


def finish_layer(
    attn: torch.Tensor,  # [num_tokens, num_heads, head_dim], the attention backend's output
    hidden: torch.Tensor,  # [num_tokens, hidden_size], the layer's input (residual stream)
    o_proj: torch.Tensor,  # [hidden_size, num_heads * head_dim]
    post_norm_weight: torch.Tensor,  # [hidden_size]
    gate_up_proj: torch.Tensor,  # [2 * intermediate_size, hidden_size]
    down_proj: torch.Tensor,  # [hidden_size, intermediate_size]
    norm_eps: float,
) -> torch.Tensor:  # [num_tokens, hidden_size], the layer's output
    """The rest of an unsharded layer after attention: output projection and residual, then
    the post-attention RMSNorm, SwiGLU MLP and residual."""
    hidden = hidden + F.linear(attn.reshape(attn.shape[0], -1), o_proj)
    gate, up = F.linear(rms_norm(hidden, post_norm_weight, norm_eps), gate_up_proj).split(
        down_proj.shape[1], dim=-1
    )
    return hidden + F.linear(F.silu(gate) * up, down_proj)
