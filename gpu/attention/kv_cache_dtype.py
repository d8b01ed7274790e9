"""--kv-cache-dtype: the paged KV cache's element type, and the checkpoint scales of an
fp8 cache.

auto stores keys and values in the model dtype. fp8 (= fp8_e4m3, vLLM's names) stores
float8_e4m3fn with one float32 k_scale and one v_scale per layer (the cache holds
key / k_scale, value / v_scale: kernels/_kv_fp8.py): half the bytes of bf16, so the same
memory holds twice the tokens. The scales are 1.0 (vLLM's default) unless the checkpoint
carries them, as `<layer>.self_attn.k_scale` / `v_scale` or, in compressed-tensors FP8
checkpoints, `<layer>.self_attn.k_proj.output_scale` / `v_proj.output_scale`; they are
loaded whatever the cache dtype and only an fp8 cache reads them.

Where it runs: the Triton kernels read e4m3 on CUDA devices of compute capability 8.9 and
later (Ada, Hopper) only; torch stores and converts float8 on CPU, so the CPU path (the
torch references) serves an fp8 cache too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kernels._kv_fp8 import FP8_KV_DTYPE, is_fp8_kv

KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_MIN_CAPABILITY = (8, 9)
"""Ada / Hopper and later: Triton's float8 e4m3 conversions need sm89+."""
_KV_SCALE_ALIASES = {
    "self_attn.k_scale": "self_attn.k_scale",
    "self_attn.v_scale": "self_attn.v_scale",
    "self_attn.attn.k_scale": "self_attn.k_scale",
    "self_attn.attn.v_scale": "self_attn.v_scale",
    "self_attn.k_proj.output_scale": "self_attn.k_scale",
    "self_attn.v_proj.output_scale": "self_attn.v_scale",
}
"""Checkpoint name within a layer -> the name the loaders give it (the model's buffer)."""
_LAYER_NAME = re.compile(r"^(model\.layers\.\d+\.)(.+)$")


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for a --kv-cache-dtype choice."""
    if choice == "auto":
        return model_dtype
    if choice in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(
        f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {choice!r}"
    )


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """How logs and reports name a KV cache dtype: fp8_e4m3, bfloat16, float32, ..."""
    return "fp8_e4m3" if is_fp8_kv(dtype) else str(dtype).removeprefix("torch.")


def kv_cache_dtype_refusal(
    choice: str,
    device_type: str,
    compute_capability: tuple[int, int] | None,
    device_name: str = "this GPU",
) -> str | None:
    """Why this device cannot hold a `choice` (--kv-cache-dtype) KV cache, in one line, or
    None when it can: fp8 on a CUDA device below compute capability 8.9."""
    if choice == "auto" or device_type != "cuda":
        return None
    if compute_capability is not None and compute_capability >= FP8_KV_MIN_CAPABILITY:
        return None
    have = "unknown" if compute_capability is None else "%d.%d" % compute_capability
    return (
        "--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper), "
        f"where Triton reads float8 e4m3; {device_name} is {have}: use --kv-cache-dtype auto"
    )


def kv_scale_name(name: str) -> str | None:
    """The loaders' name for checkpoint tensor `name` when it is a KV cache scale
    (`model.layers.<i>.self_attn.k_scale` or `v_scale`), else None."""
    match = _LAYER_NAME.match(name)
    if match is None or match.group(2) not in _KV_SCALE_ALIASES:
        return None
    return match.group(1) + _KV_SCALE_ALIASES[match.group(2)]


def checkpoint_kv_scale(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint's KV cache scale as the model keeps it: a float32 [] tensor. Raises
    ValueError unless it is one positive finite number."""
    if tensor.numel() != 1 or not tensor.dtype.is_floating_point:
        raise ValueError(
            f"KV cache scale {name!r} must hold one float, got {tensor.dtype} {tuple(tensor.shape)}"
        )
    scale = tensor.detach().to(torch.float32).reshape(())
    value = float(scale)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"KV cache scale {name!r} must be positive and finite, got {value}")
    return scale


def load_kv_scales(
    weights: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],  # loader name -> the layer's [] float32 buffer
    consume: bool,
) -> Mapping[str, torch.Tensor]:
    """Copy the KV cache scales found in `weights` into their buffers and return the
    other weights: `weights` itself with the scales popped when consume (then a dict), a
    new mapping otherwise. Scales are optional: a missing one keeps its buffer's value."""
    # every scale is checked before any is copied
    found = {name: checkpoint_kv_scale(name, weights[name]) for name in weights if name in targets}
    for name, scale in found.items():
        targets[name].copy_(scale)
    if consume:
        for name in found:
            del weights[name]  # type: ignore[attr-defined]
        return weights
    return {name: tensor for name, tensor in weights.items() if name not in targets}
