"""The float8 (e4m3) paged KV cache's quantization, shared by every kernel that writes or
reads the cache (kv_write, qkv_prologue, paged_attention) and by their torch references.

A layer's cache holds key / k_scale and value / v_scale, clamped to e4m3's finite range
(+-448) and rounded to nearest even; k_scale and v_scale are float32 scalars on the
cache's device (one per layer, 1.0 unless the checkpoint gives them), so a CUDA graph
reads whatever they hold at replay. A reader multiplies back: keys by k_scale, values by
v_scale. An unquantized cache (the model dtype) ignores the scales.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, tl, triton

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
"""e4m3fn's largest finite value (it has no infinity; 0x7f is NaN)."""

if HAS_TRITON:

    @triton.jit
    def quantize_e4m3(x, scale):
        """x / scale clamped to +-448 and rounded to e4m3's precision, as float32 values
        that e4m3 holds exactly (the caller's cast to float8 is then exact).

        The rounding is done here, in float32 bits, rather than by the cast: Triton's
        interpreter casts float32 to float8 by truncating with a half-up bump that does not
        carry into the exponent (1.99 -> 1.0), so only this way does the interpreted kernel
        compute what the GPU and torch do (round to nearest even)."""
        # IEEE division, as torch divides (Triton's `/` is approximate in float32 on GPUs)
        y = tl.div_rn(x.to(tl.float32), scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        # Normal range: keep 3 of float32's 23 mantissa bits, to nearest even (the add
        # carries into the exponent when the mantissa overflows).
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        # Below e4m3's smallest normal (2^-6) its spacing is a fixed 2^-9: adding and taking
        # away 1.5 * 2^14, whose float32 spacing is 2^-9, rounds to it (to nearest even);
        # on the magnitude, with the sign put back, so that -0.0 stays -0.0 as in torch.
        magnitude = (tl.abs(y) + 24576.0) - 24576.0
        sign = y.to(tl.uint32, bitcast=True) & 0x80000000
        subnormal = (magnitude.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


def quantize_kv_ref(
    x: torch.Tensor,  # [...] float32/bfloat16/float16
    scale: torch.Tensor,  # [] or [1] float32
) -> torch.Tensor:  # [...] float8_e4m3fn
    """Plain torch version of `quantize_e4m3` followed by the cast."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def is_fp8_kv(kv_dtype: torch.dtype) -> bool:
    return kv_dtype == FP8_KV_DTYPE


def check_kv_scales(
    kv_dtype: torch.dtype,
    device: torch.device,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """An fp8 cache needs both scales: one float32 value each, on the cache's device. An
    unquantized cache takes them or None (the model passes them whatever its cache)."""
    if not is_fp8_kv(kv_dtype):
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (
            not isinstance(scale, torch.Tensor)
            or scale.numel() != 1
            or scale.dtype != torch.float32
            or scale.device != device
        ):
            got = (
                f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
                if isinstance(scale, torch.Tensor)
                else repr(scale)
            )
            raise ValueError(
                f"a {kv_dtype} KV cache needs {name} as one float32 value on {device}, got {got}"
            )
