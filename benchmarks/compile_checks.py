"""The kernel launches compile_check.py compiles: representative shapes of qwen3-0.6b (and
a llama-shaped head layout), each through the kernel's own launcher on CPU tensors."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# Kernels are imported (and jitted for the GPU) first; launchers then see this variable
# only in their device check, which otherwise refuses CPU tensors.
from kernels import (  # noqa: E402
    gumbel_sample, paged_attention, post_update, prepare_inputs, qkv_prologue, rms_norm,
    sampling_thresholds, silu_mul, slot_mapping,
)

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


def _input_prep() -> None:
    i32, i64 = torch.int32, torch.int64
    counts = torch.zeros(2, dtype=i32)
    rows, qsl = torch.zeros(8, dtype=i32), torch.zeros(9, dtype=i32)
    history, table = torch.zeros(8, 64, dtype=i32), torch.zeros(8, 4, dtype=i32)
    for step_counts in (None, counts):
        prepare_inputs.prepare_inputs_triton(rows, qsl, history, torch.zeros(8, dtype=i32),
                                             torch.zeros(16, dtype=i64), torch.zeros(16, dtype=i64),
                                             torch.zeros(8, dtype=i32), 8, 16, step_counts)
        slot_mapping.gather_block_table_triton(rows, table, table.clone(), 8, step_counts)
        slot_mapping.compute_slot_mapping_triton(qsl, torch.zeros(16, dtype=i64), table, 16,
                                                 torch.zeros(16, dtype=i64), 8, 16, step_counts)
        post_update.post_update_triton(rows, qsl, torch.zeros(8, dtype=i64), torch.zeros(8, dtype=i32),
                                       torch.zeros(8, dtype=i32), history, torch.zeros(8, dtype=i64),
                                       8, step_counts)


def _gumbel_sample() -> None:
    logits = torch.zeros(4, 151936)
    rows = torch.arange(4, dtype=torch.int32)
    for thresholds in (None, torch.zeros(4)):
        gumbel_sample.gumbel_sample_triton(logits, rows, torch.ones(4), torch.zeros(4, dtype=torch.int64),
                                           torch.zeros(4, dtype=torch.int64), thresholds=thresholds)


def _paged_attention() -> None:
    cache = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16)
    for num_tokens, max_query_len, query_tile in ((4, 1, None), (64, 64, None), (64, 64, 16)):
        query = torch.zeros(num_tokens, 16, 128, dtype=torch.bfloat16)
        paged_attention.paged_attention_triton(
            query, cache, cache, torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
            torch.tensor([0, 1, 2, 3, num_tokens], dtype=torch.int32), 0.1,
            max_query_len=max_query_len, max_seq_len=128, num_kv_splits=1, query_tile=query_tile)


CHECKS: dict[str, Callable[[], None]] = {
    "input_prep": _input_prep,
    "gumbel_sample": _gumbel_sample,
    "paged_attention": _paged_attention,
    "sampling_thresholds": _sampling_thresholds,
    "rms_norm": _rms_norm,
    "silu_mul": _silu_mul,
    "qkv_prologue": _qkv_prologue,
}
