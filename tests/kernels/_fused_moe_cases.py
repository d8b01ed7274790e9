"""What test_fused_moe.py and the CUDA tests test_fused_moe*_cuda.py share: random MoE cases
(experts in the model dtype, MXFP4 or FP8 with per-channel or 128x128 block scales) and the
checks that run them, in the Triton interpreter or on a GPU: Triton's grouping and fused MoE
against their references, and blocks past the padded count exiting early."""

from __future__ import annotations

import os
from typing import Any

import torch

from kernels._moe_align import group_pairs_ref, group_pairs_triton
from kernels.fp8_quant import FP8_DTYPE, FP8_MAX
from kernels.fused_moe import (
    Fp8Experts,
    MoEActivation,
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    tile_config,
)
from kernels.mxfp4 import MXFP4Tensor, quantize_mxfp4
from tests.kernels._triton_interpreter import assert_interpreted

SILU = MoEActivation("silu")
SWIGLU = MoEActivation("swiglu_clamped")
FP8_BLOCK = 128


def _fp8_experts(
    w: torch.Tensor, kind: str, num_parts: int, generator: torch.Generator
) -> Fp8Experts:
    """Random e4m3 values under random scales of w's size ([E, N] per channel, or 128x128
    blocks of each of `num_parts` row parts) that differ up to 100x, so that a scale read
    from the wrong row or block shows; the dequantized values have w's standard deviation."""
    num_experts, num_rows, num_cols = w.shape
    values = (torch.randn(w.shape, generator=generator) * 64).clamp(-FP8_MAX, FP8_MAX)
    part_blocks = -(-num_rows // num_parts // FP8_BLOCK)
    scale_shape = (
        (num_experts, num_rows)
        if kind == "channel"
        else (num_experts, num_parts * part_blocks, -(-num_cols // FP8_BLOCK))
    )
    spread = torch.exp(torch.rand(scale_shape, generator=generator) * 4.6)
    scale = spread * (float(w.std()) / 64 / float(spread.mean()))
    return Fp8Experts(values.to(FP8_DTYPE), scale)


def _case(
    num_tokens,
    hidden,
    intermediate,
    num_experts,
    top_k,
    dtype,
    *,
    seed=0,
    mxfp4=False,
    fp8=None,
    bias=True,
    device="cpu",
    routing=None,
):
    """(hidden, weights, ids, w13, w2, b13, b2) with distinct random top-k ids per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    if routing is None:
        routing = torch.rand(num_tokens, num_experts, generator=g).argsort(-1)[:, :top_k]
    ids = routing.to(torch.int32)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g), -1)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * hidden**-0.5 * 2
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) * intermediate**-0.5
    b13 = torch.randn(num_experts, 2 * intermediate, generator=g) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=g) * 0.1 if bias else None
    if mxfp4:
        w13, w2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        w13 = MXFP4Tensor(w13.blocks.to(device), w13.scales.to(device))
        w2 = MXFP4Tensor(w2.blocks.to(device), w2.scales.to(device))
    elif fp8 is not None:  # "channel" or "block" scales
        w13, w2 = _fp8_experts(w13, fp8, 2, g), _fp8_experts(w2, fp8, 1, g)
        w13 = Fp8Experts(w13.weight.to(device), w13.scale.to(device))
        w2 = Fp8Experts(w2.weight.to(device), w2.scale.to(device))
    else:
        w13, w2 = w13.to(dtype).to(device), w2.to(dtype).to(device)

    def move(t, to_dtype=None):
        return None if t is None else t.to(device, to_dtype or t.dtype)

    return (move(x, dtype), move(weights), move(ids), w13, w2, move(b13, dtype), move(b2, dtype))


def compare_grouping(device: str, cases: list[tuple[int, int, int, int]]) -> None:
    if device == "cpu":
        from kernels import _moe_align

        assert_interpreted(_moe_align._count_kernel, _moe_align._place_kernel)
    generator = torch.Generator().manual_seed(2)
    for num_tokens, num_experts, top_k, block_m in cases:
        scores = torch.rand(num_tokens, num_experts, generator=generator)
        scores[:, : num_experts // 2] += 1  # half the experts get every token, half none
        for ids in (
            scores.argsort(-1, descending=True)[:, :top_k],
            torch.rand(scores.shape, generator=generator).argsort(-1)[:, :top_k],
        ):
            ids = ids.to(torch.int32).to(device)
            ours, ref = (
                group_pairs_triton(ids, num_experts, block_m),
                group_pairs_ref(ids, num_experts, block_m),
            )
            num_rows = int(ref.num_padded_rows)
            assert int(ours.num_padded_rows) == num_rows
            assert torch.equal(ours.sorted_pair_ids[:num_rows], ref.sorted_pair_ids[:num_rows])
            blocks = num_rows // block_m
            assert torch.equal(ours.block_expert_ids[:blocks], ref.block_expert_ids[:blocks])


def _assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernel rounds each slot's product to the model dtype before the sum over slots,
    and its float32 sums run in another order: a few steps of the format at the output's
    scale (more in the interpreter, which truncates to bf16 where a GPU rounds)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = float(expected.float().abs().max())
    if expected.dtype == torch.float32:
        rtol = 1e-4
    else:
        rtol = 3e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 2**-6
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale)
    mean_error = (actual.float() - expected.float()).abs().mean()
    assert mean_error <= rtol * scale / 8, f"mean error {mean_error} at scale {scale}"


def compare_fused(device: str, cases: list[dict]) -> None:
    if device == "cpu":
        from kernels import _moe_gemm

        assert_interpreted(_moe_gemm._moe_gemm1_kernel, _moe_gemm._moe_gemm2_kernel)
    for case in cases:
        case = dict(case)
        activation = SILU if case.pop("activation") == "silu" else SWIGLU
        dtype = getattr(torch, case.pop("dtype"))
        routing = case.pop("routing", None)
        if routing is not None:
            routing = torch.tensor(routing)
        args = _case(*case.pop("shape"), dtype, device=device, routing=routing, **case)
        out = fused_moe_triton(*args, activation)
        _assert_close_to_reference(out, fused_moe_ref(*args, activation))
        if device == "cuda":
            assert torch.equal(fused_moe(*args, activation), out), "not reproducible"


def _interpreter_cases() -> list[dict]:
    cases = []
    for num_tokens in (1, 3, 17):
        for activation in ("silu", "swiglu_clamped"):
            cases.append(
                dict(
                    shape=(num_tokens, 64, 32, 8, 2),
                    dtype="float32",
                    activation=activation,
                    bias=num_tokens != 3,
                )
            )
            cases.append(
                dict(
                    shape=(num_tokens, 64, 64, 4, 4),
                    dtype="bfloat16",
                    activation=activation,
                    bias=num_tokens != 1,
                )
            )
            cases.append(
                dict(
                    shape=(num_tokens, 64, 32, 8, 4),
                    dtype="bfloat16",
                    activation=activation,
                    mxfp4=True,
                    bias=num_tokens == 17,
                )
            )
    # one expert receives every token; experts 2.. receive none
    every = [[0, 1]] * 17
    cases.append(dict(shape=(17, 64, 32, 8, 2), dtype="float32", activation="silu", routing=every))
    cases.append(
        dict(
            shape=(17, 64, 32, 8, 2),
            dtype="bfloat16",
            activation="swiglu_clamped",
            mxfp4=True,
            routing=every,
        )
    )
    return cases + _fp8_cases()


def _fp8_cases() -> list[dict[str, Any]]:
    """FP8 experts: per-channel scales with and without bias; block scales at hidden 192
    and intermediate 160 (partial blocks along both dims of both GEMMs, the up half of w13
    blocked apart from the gate); with experts 0 and 1 receiving every token; and 400 tokens,
    over 96 rows per expert, where FP8 takes its own wide-M tile."""
    every = [[0, 1]] * 17
    return [
        dict(shape=(5, 64, 32, 8, 4), dtype="bfloat16", activation="swiglu_clamped", fp8="channel"),
        dict(shape=(17, 64, 32, 8, 2), dtype="float32", activation="silu", fp8="channel",
             bias=False, routing=every),
        dict(shape=(3, 192, 160, 4, 2), dtype="bfloat16", activation="silu", fp8="block",
             bias=False),
        dict(shape=(17, 192, 160, 8, 2), dtype="float32", activation="silu", fp8="block",
             routing=every),
        dict(shape=(400, 64, 32, 8, 2), dtype="bfloat16", activation="swiglu_clamped",
             fp8="channel"),
        dict(shape=(400, 192, 160, 8, 2), dtype="float32", activation="silu", fp8="block",
             bias=False),
    ]  # fmt: skip


def check_blocks_past_the_padded_count_exit(device: str) -> None:
    """Blocks past num_padded_rows point at a real pair and expert; a block that did not
    exit early would overwrite that pair's rows with the wrong expert's output."""
    from kernels import fused_moe as module

    x, w, ids, w13, w2, b13, b2 = _case(3, 64, 32, 8, 2, torch.float32, seed=3, device=device)
    config = tile_config(6, 8)
    grouping = group_pairs_ref(ids, 8, config.block_m)
    num_blocks = int(grouping.num_padded_rows) // config.block_m
    assert grouping.block_expert_ids.shape[0] > num_blocks
    grouping.sorted_pair_ids[num_blocks * config.block_m :] = 0
    grouping.block_expert_ids[num_blocks:] = (int(ids[0, 0]) + 1) % 8
    act = torch.zeros(6, 32, device=device)
    module._launch_gemm1(x, w13, b13, act, grouping, 2, SILU, config)
    out = torch.zeros(6, 64, device=device)
    module._launch_gemm2(act, w2, b2, w.flatten(), out, grouping, config)
    expected = fused_moe_ref(x, w, ids, w13, w2, b13, b2, SILU)
    torch.testing.assert_close(out.view(3, 2, 64).sum(1), expected, rtol=1e-4, atol=1e-4)
