"""How closely a fused kernel must match its torch reference.

float32: float32 rounding (reductions add in another order). bfloat16 and float16 on a
GPU: a step or two of the format at the tensor's scale, on few elements: the fused kernel
rounds once from float32 where the reference rounds after each op (an fp32 difference in a
norm's rsqrt that lands on the other side of a rounding boundary, carried through a
multiply or subtraction). bfloat16 under Triton's CPU interpreter: a few steps, since the
interpreter truncates float32 to bf16 where the GPU rounds to nearest (every rounding point
of a kernel may then differ by one step).
"""

from __future__ import annotations

import os

import torch


def assert_matches_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all() == torch.isfinite(expected).all()
    if actual.dtype in (torch.bfloat16, torch.float16):
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        rtol = 3e-2 if interpreted and actual.dtype == torch.bfloat16 else 2**-7
        scale = float(expected.float().abs().max()) if expected.numel() else 0.0
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale)
        if not interpreted:  # rare: only values near a rounding boundary may move
            assert (actual != expected).float().mean() < 0.01
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-5, atol=1e-5)
