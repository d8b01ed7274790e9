"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SwiGLU MLP.

Parameters are allocated uninitialised (`torch.empty`); `DecoderModel.load_weights` fills
them. The MLP's projections are FP8 where gpu/models/precision.py says
(gpu/models/fp8_linear.py). The math follows Hugging Face transformers so that float32
results match it; on CUDA the fused kernels of kernels/ (rms_norm, silu_mul) compute it,
elsewhere their torch references.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpu.models.config import UnsupportedModelError
from gpu.models.fp8_linear import linear, projection
from gpu.models.precision import ProjectionScheme
from kernels.qkv_prologue import apply_rotary_ref as apply_rotary
from kernels.rms_norm import add_rms_norm
from kernels.silu_mul import silu_mul

__all__ = [
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "apply_rotary",
    "empty_parameter",
    "rope_attention_factor",
    "rope_inv_freq",
]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 and cast back like transformers."""

    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(
        self,
        x: torch.Tensor,  # [num_tokens, dim]
        residual: torch.Tensor | None,  # [num_tokens, dim]; None: x starts the residual stream
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual), x + residual)
        return add_rms_norm(x, residual, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul; either
    projection may be FP8 or int4 (gpu/models/fp8_linear.py) when its scheme says so."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        gate_up_scheme: ProjectionScheme | None = None,
        down_scheme: ProjectionScheme | None = None,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # rows [0, intermediate) are gate_proj, rows [intermediate, 2 * intermediate) up_proj
        self.gate_up_proj = projection(
            2 * intermediate_size, hidden_size, dtype, device, gate_up_scheme
        )
        self.down_proj = projection(hidden_size, intermediate_size, dtype, device, down_scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        return linear(silu_mul(linear(x, self.gate_up_proj)), self.down_proj)


def rope_inv_freq(
    head_dim: int, theta: float, rope_scaling: Mapping[str, Any] | None
) -> torch.Tensor:
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
    if rope_type == "yarn":
        return _yarn_inv_freq(theta**exponents, head_dim, theta, rope_scaling)
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


def _yarn_inv_freq(
    pos_freqs: torch.Tensor,  # [head_dim // 2] theta ** (2i / head_dim)
    head_dim: int,
    theta: float,
    rope_scaling: Mapping[str, Any],
) -> torch.Tensor:
    # YaRN: dimensions that turn fewer than beta_slow times over the original context are
    # interpolated (slowed down by `factor`), those that turn more than beta_fast times are
    # kept, with a linear ramp between.
    factor = rope_scaling["factor"]
    original_len = rope_scaling["original_max_position_embeddings"]
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        turns = original_len / (num_rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope_scaling: Mapping[str, Any] | None) -> float:
    """The factor YaRN scales cos and sin by (1 for every other rope type), as transformers
    computes it: `attention_factor` if given, else from `factor`, `mscale` and
    `mscale_all_dim`."""
    rope_scaling = rope_scaling or {}
    if rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = rope_scaling["factor"]
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the neox / HF `rotate_half` layout.

    cos and sin are precomputed in float32 for every position below `max_positions` (YaRN's
    attention factor already multiplied in); the attention prologue
    (kernels/qkv_prologue.py) looks them up by position.
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
        scale = rope_attention_factor(rope_scaling)
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", (angles.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin_cache", (angles.sin() * scale).to(device), persistent=False)

    def cos_sin(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, 1, head_dim // 2] dtype
        cos = self.cos_cache.index_select(0, positions).to(dtype)
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)
