"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SwiGLU MLP.

Parameters are allocated uninitialised (`torch.empty`); `DecoderModel.load_weights` fills
them. The math follows Hugging Face transformers so that float32 results match it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu.models.config import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 and cast back like transformers."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., dim] -> [..., dim]: RMSNorm in float32, cast back, then scaled by `weight` [dim]."""
    x_fp32 = x.float()
    inv_rms = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x_fp32 * inv_rms).to(x.dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # rows [0, intermediate) are gate_proj, rows [intermediate, 2 * intermediate) up_proj
        self.gate_up_proj = empty_parameter(2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.down_proj = empty_parameter(hidden_size, intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        return swiglu_mlp(x, self.gate_up_proj, self.down_proj)


def swiglu_mlp(
    x: torch.Tensor,  # [num_tokens, hidden]
    gate_up_proj: torch.Tensor,  # [2 * intermediate, hidden]: gate rows, then up rows
    down_proj: torch.Tensor,  # [hidden, intermediate]
) -> torch.Tensor:  # [num_tokens, hidden]
    gate, up = F.linear(x, gate_up_proj).split(down_proj.shape[1], dim=-1)
    return F.linear(F.silu(gate) * up, down_proj)


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise UnsupportedModelError(
        f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: Mapping[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band
    # in between interpolated smoothly.
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the neox / HF `rotate_half` layout.

    cos and sin are precomputed in float32 for every position below `max_positions`; a
    forward pass looks them up once (`cos_sin`) and every layer reuses them (`apply`).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        rope_scaling: Mapping[str, Any] | None,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
        angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", angles.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", angles.sin().to(device), persistent=False)

    def cos_sin(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, 1, head_dim // 2] dtype
        return rotary_cos_sin(self.cos_cache, self.sin_cache, positions, dtype)


def rotary_cos_sin(
    cos_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    positions: torch.Tensor,  # [num_tokens] int64
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, 1, head_dim // 2] dtype
    cos = cos_cache.index_select(0, positions).to(dtype)
    sin = sin_cache.index_select(0, positions).to(dtype)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
    # Same arithmetic as transformers' `x * cos + rotate_half(x) * sin` on half-width tensors.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
