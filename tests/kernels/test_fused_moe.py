"""fused_moe: the reference against a per-token loop, the grouping, Triton vs reference (in the
interpreter and at model shapes on a GPU), CUDA-graph replay; experts in the model dtype,
MXFP4 and FP8 (per-channel and 128x128 block scales, with shapes that are not multiples of
128), and FP8 scales of the wrong shape refused."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kernels._moe_align import group_pairs_ref, group_pairs_triton, max_num_blocks
from kernels.fp8_quant import FP8_DTYPE, FP8_MAX
from kernels.fused_moe import (
    Fp8Experts,
    MoEActivation,
    TileConfig,
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    tile_config,
)
from kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4, quantize_mxfp4
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
    needs_triton,
)

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


def _fp8_dequantized(w: Fp8Experts, num_parts: int) -> torch.Tensor:  # [E, N, K] float64
    """The format's definition, element by element: value x the scale of its row, or of
    the block of its row part and column."""
    values = w.weight.double()
    if w.scale.dim() == 2:
        return values * w.scale.double()[:, :, None]
    num_rows, num_cols = values.shape[1:]
    part_rows = num_rows // num_parts
    rows = torch.arange(num_rows)
    block_rows = (rows // part_rows) * -(-part_rows // FP8_BLOCK) + (rows % part_rows) // FP8_BLOCK
    block_cols = torch.arange(num_cols) // FP8_BLOCK
    return values * w.scale.double()[:, block_rows][:, :, block_cols]


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


def _per_token_loop(x, weights, ids, w13, w2, b13, b2, activation):
    """out_t = sum_j w_tj expert_e(x_t), one token and slot at a time, in float64."""
    if isinstance(w13, MXFP4Tensor):
        w13, w2 = dequantize_mxfp4(w13, torch.float64), dequantize_mxfp4(w2, torch.float64)
    if isinstance(w13, Fp8Experts):
        w13, w2 = _fp8_dequantized(w13, 2), _fp8_dequantized(w2, 1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    intermediate = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            if b13 is not None:
                h = h + b13[e].double()
            gate, up = h[:intermediate], h[intermediate:]
            if activation.kind == "silu":
                act = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=activation.limit), up.clamp(-7.0, activation.limit)
                act = (up + 1) * gate * torch.sigmoid(activation.alpha * gate)
            act = act.to(x.dtype).double()  # stored in the model dtype between the GEMMs
            y = w2[e].double() @ act + (b2[e].double() if b2 is not None else 0)
            out[t] += float(weights[t, j]) * y
    return out


WEIGHT_KINDS = {"plain": {}, "mxfp4": {"mxfp4": True}, "fp8_channel": {"fp8": "channel"}}


@pytest.mark.parametrize("activation", [SILU, SWIGLU], ids=lambda a: a.kind)
@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_reference_equals_per_token_loop(activation: MoEActivation, kind: str) -> None:
    weights = WEIGHT_KINDS[kind]
    args = _case(9, 64, 32, 6, 3, torch.float32, seed=1, **weights)
    expected = _per_token_loop(*args, activation)
    torch.testing.assert_close(
        fused_moe_ref(*args, activation).double(), expected, rtol=1e-5, atol=1e-5
    )
    assert torch.equal(fused_moe(*args, activation), fused_moe_ref(*args, activation))
    bf16 = _case(9, 64, 32, 6, 3, torch.bfloat16, seed=1, bias=False, **weights)
    out = fused_moe_ref(*bf16, activation)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.double(), _per_token_loop(*bf16, activation), rtol=1e-2, atol=1e-2
    )


def test_block_scaled_reference_reads_each_half_of_w13_in_its_own_blocks() -> None:
    # hidden 192 and intermediate 160: partial blocks along both dims, and the up half
    # starting inside the fused rows' second 128-row block
    args = _case(7, 192, 160, 4, 2, torch.float32, fp8="block", seed=4)
    expected = _per_token_loop(*args, SILU)
    torch.testing.assert_close(
        fused_moe_ref(*args, SILU).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max()
    )


def test_fp8_scales_of_the_wrong_shape_are_refused() -> None:
    x, w, ids, w13, w2, _, _ = _case(2, 192, 160, 4, 2, torch.float32, fp8="block", bias=False)
    # blocks of the fused rows (ceil(320 / 128) = 3) instead of each half's (2 + 2)
    fused_blocks = Fp8Experts(w13.weight, w13.scale[:, :3].contiguous())
    with pytest.raises(
        ValueError, match=r"w13 scale must be \[4, 320\] or \[4, 4, 2\], got \[4, 3, 2\]"
    ):
        fused_moe_ref(x, w, ids, fused_blocks, w2, None, None, SILU)
    per_input_column = Fp8Experts(w2.weight, torch.ones(4, 160))
    with pytest.raises(
        ValueError, match=r"w2 scale must be \[4, 192\] or \[4, 2, 2\], got \[4, 160\]"
    ):
        fused_moe(x, w, ids, w13, per_input_column, None, None, SILU)
    with pytest.raises(ValueError, match="w2 scale must be a float32 tensor"):
        fused_moe(x, w, ids, w13, Fp8Experts(w2.weight, w2.scale.double()), None, None, SILU)
    with pytest.raises(ValueError, match="must be float8_e4m3fn, got torch.bfloat16"):
        Fp8Experts(w2.weight.bfloat16(), w2.scale)


@needs_triton
def test_the_launcher_refuses_bad_fp8_scales_and_tiles_before_launching() -> None:
    x, w, ids, w13, w2, _, _ = _case(2, 192, 160, 4, 2, torch.float32, fp8="block", bias=False)
    with pytest.raises(ValueError, match=r"w13 scale must be \[4, 320\] or \[4, 4, 2\]"):
        fused_moe_triton(x, w, ids, Fp8Experts(w13.weight, w13.scale[:, :3]), w2, None, None, SILU)
    tile = TileConfig(16, 64, 256, 4, 3)  # a K tile across two scale blocks
    with pytest.raises(ValueError, match="block_k that divides 128"):
        fused_moe_triton(x, w, ids, w13, w2, None, None, SILU, tile)


def test_swiglu_clamps_gate_and_up() -> None:
    # one expert whose projections are the identity: gate = x[:2], up = x[2:4]
    w13 = torch.eye(4).view(1, 4, 4)
    w2 = torch.eye(4)[:, :2].reshape(1, 4, 2).contiguous()
    x = torch.tensor([[10.0, -2.0, -9.0, 8.0]])
    out = fused_moe_ref(
        x, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), w13, w2, None, None, SWIGLU
    )
    gate, up = torch.tensor([7.0, -2.0]), torch.tensor([-7.0, 7.0])
    expected = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    torch.testing.assert_close(out[0, :2], expected)
    assert out[0, 2:].abs().max() == 0


def test_bad_shapes_are_refused() -> None:
    x, w, ids, w13, w2, _, _ = _case(2, 64, 32, 4, 2, torch.float32, bias=False)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe_ref(x, w, ids, w13, w2[:, :, :16], None, None, SILU)
    with pytest.raises(ValueError, match="int32"):
        fused_moe_ref(x, w, ids.long(), w13, w2, None, None, SILU)
    with pytest.raises(ValueError, match="bfloat16"):
        fused_moe_ref(x, w, ids, w13.bfloat16(), w2.bfloat16(), None, None, SILU)


def test_grouping_reference_pads_each_expert_to_whole_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]], dtype=torch.int32)  # expert 2 gets nothing
    grouping = group_pairs_ref(ids, num_experts=5, block_m=4)
    num_rows = int(grouping.num_padded_rows)
    assert num_rows == 12  # experts 0, 1, 3: one block each
    assert grouping.sorted_pair_ids[:num_rows].tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]
    assert grouping.block_expert_ids[:3].tolist() == [0, 1, 3]
    assert grouping.sorted_pair_ids.shape[0] == 4 * max_num_blocks(6, 5, 4)


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


test_triton_grouping_matches_reference_in_interpreter = interpreted_test(
    __file__,
    "compare_grouping",
    kwargs={
        "device": "cpu",
        "cases": [(1, 8, 2, 16), (17, 8, 4, 16), (40, 4, 2, 16), (300, 16, 4, 32)],
    },
)


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
    blocked apart from the gate); and with experts 0 and 1 receiving every token."""
    every = [[0, 1]] * 17
    return [
        dict(shape=(5, 64, 32, 8, 4), dtype="bfloat16", activation="swiglu_clamped", fp8="channel"),
        dict(shape=(17, 64, 32, 8, 2), dtype="float32", activation="silu", fp8="channel",
             bias=False, routing=every),
        dict(shape=(3, 192, 160, 4, 2), dtype="bfloat16", activation="silu", fp8="block",
             bias=False),
        dict(shape=(17, 192, 160, 8, 2), dtype="float32", activation="silu", fp8="block",
             routing=every),
    ]  # fmt: skip


test_triton_matches_reference_in_interpreter = interpreted_test(
    __file__, "compare_fused", kwargs={"device": "cpu", "cases": _interpreter_cases()}
)


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


test_blocks_past_the_padded_count_exit_in_interpreter = interpreted_test(
    __file__, "check_blocks_past_the_padded_count_exit", kwargs={"device": "cpu"}
)


def test_tile_config_grows_block_m_with_rows_per_expert() -> None:
    decode, prefill = tile_config(8, 128), tile_config(2048 * 8, 128)
    assert decode.block_m == 16 and prefill.block_m == 128
    assert tile_config(2048 * 4, 32, mxfp4=True).block_m == 64  # dequantizing tiles: smaller
    assert max_num_blocks(8, 128, 16) == 8  # batch 1, top 8: at most one block per expert


_GPT_OSS_20B = dict(
    shape=(0, 2880, 2880, 32, 4), dtype="bfloat16", activation="swiglu_clamped", mxfp4=True
)
_QWEN3_30B = dict(shape=(0, 2048, 768, 128, 8), dtype="bfloat16", activation="silu", bias=False)


def _at(case: dict, num_tokens: int) -> dict:
    return {**case, "shape": (num_tokens, *case["shape"][1:])}


@cuda_test
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_gpt_oss_20b_shapes_on_cuda(num_tokens: int) -> None:
    compare_fused("cuda", [_at(_GPT_OSS_20B, num_tokens)])


@cuda_test
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_qwen3_30b_a3b_shapes_on_cuda(num_tokens: int) -> None:
    compare_fused("cuda", [_at(_QWEN3_30B, num_tokens)])


def _has_fp8_conversions() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(
    not _has_fp8_conversions(), reason="needs compute capability >= 8.9 (e4m3 conversions)"
)


@cuda_test
@needs_fp8
@pytest.mark.parametrize("fp8", ["block", "channel"])
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_qwen3_30b_a3b_fp8_shapes_on_cuda(num_tokens: int, fp8: str) -> None:
    """Qwen3-30B-A3B-FP8's experts (intermediate 768: six 128-row blocks a half)."""
    compare_fused("cuda", [_at({**_QWEN3_30B, "fp8": fp8}, num_tokens)])


@cuda_test
def test_small_cases_and_grouping_on_cuda() -> None:
    fp8_ok = _has_fp8_conversions()  # e4m3 conversions: compute capability >= 8.9
    compare_fused("cuda", [c for c in _interpreter_cases() if fp8_ok or "fp8" not in c])
    compare_grouping("cuda", [(1, 128, 8, 16), (2048, 128, 8, 128), (4096, 32, 4, 64)])
    check_blocks_past_the_padded_count_exit("cuda")


@cuda_test
@pytest.mark.parametrize("kind", ["plain", "mxfp4", pytest.param("fp8_block", marks=needs_fp8)])
def test_cuda_graph_replay_follows_new_routing(kind: str) -> None:
    num_tokens, num_experts, top_k = 8, 32, 4
    weights = {"plain": {}, "mxfp4": {"mxfp4": True}, "fp8_block": {"fp8": "block"}}[kind]
    x, w, ids, w13, w2, b13, b2 = _case(
        num_tokens, 256, 128, num_experts, top_k, torch.bfloat16, device="cuda", **weights
    )
    fused_moe(x, w, ids, w13, w2, b13, b2, SWIGLU)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w, ids, w13, w2, b13, b2, SWIGLU)
    generator = torch.Generator().manual_seed(7)
    for replay in range(4):
        routing = torch.rand(num_tokens, num_experts, generator=generator).argsort(-1)[:, :top_k]
        if replay == 3:
            routing[:] = torch.arange(top_k)  # every token to the same experts
        ids.copy_(routing.to(torch.int32))
        w.copy_(torch.softmax(torch.randn(num_tokens, top_k, generator=generator), -1))
        x.copy_(torch.randn(num_tokens, 256, generator=generator))
        graph.replay()
        _assert_close_to_reference(out, fused_moe_ref(x, w, ids, w13, w2, b13, b2, SWIGLU))
