"""The kernel launches compile_check.py compiles: representative shapes of qwen3-0.6b (and
a llama-shaped head layout), each through the kernel's own launcher on CPU tensors."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# Kernels are imported (and jitted for the GPU) first; launchers then see this variable
# only in their device check, which otherwise refuses CPU tensors.
from kernels import qkv_prologue, rms_norm, sampling_thresholds, silu_mul  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"


def _rms_norm() -> None:
    x = torch.zeros(8, 1024, dtype=torch.bfloat16)
    rms_norm.add_rms_norm_triton(x, x.clone(), torch.ones(1024, dtype=torch.bfloat16), 1e-6)
    rms_norm.add_rms_norm_triton(x, None, torch.ones(1024, dtype=torch.bfloat16), 1e-6)


def _silu_mul() -> None:
    silu_mul.silu_mul_triton(torch.zeros(8, 6144, dtype=torch.bfloat16))


def _qkv_prologue() -> None:
    for heads, kv_heads, head_dim, norm in ((16, 8, 128, True), (9, 3, 64, False)):
        qkv = torch.zeros(4, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
        table = torch.zeros(64, head_dim // 2)
        weight = torch.ones(head_dim, dtype=torch.bfloat16) if norm else None
        cache = torch.zeros(2, 4, 16, kv_heads, head_dim, dtype=torch.bfloat16)
        qkv_prologue.qkv_prologue_triton(qkv, torch.zeros(4, dtype=torch.int64), table, table, weight,
                                         weight, 1e-6, cache, torch.zeros(4, dtype=torch.int64),
                                         heads, kv_heads, head_dim)


def _sampling_thresholds() -> None:
    logits = torch.zeros(4, 151936)
    rows = torch.arange(4, dtype=torch.int32)
    sampling_thresholds.sampling_thresholds_triton(
        logits, rows, torch.ones(4), torch.zeros(4, dtype=torch.int32), torch.ones(4), torch.zeros(4))


CHECKS: dict[str, Callable[[], None]] = {
    "sampling_thresholds": _sampling_thresholds,
    "rms_norm": _rms_norm,
    "silu_mul": _silu_mul,
    "qkv_prologue": _qkv_prologue,
}
