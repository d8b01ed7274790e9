"""fused_moe: the reference against a per-token loop, the grouping, Triton vs reference in
the interpreter; experts in the model dtype, MXFP4 and FP8 (per-channel and 128x128 block
scales, with shapes that are not multiples of 128), and FP8 scales of the wrong shape
refused (at model shapes on a GPU, and CUDA-graph replay: test_fused_moe*_cuda.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._moe_align import group_pairs_ref, max_num_blocks
from kernels.fused_moe import (
    Fp8Experts,
    MoEActivation,
    TileConfig,
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    tile_config,
)
from kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4
from tests.kernels._fused_moe_cases import (
    FP8_BLOCK,
    SILU,
    SWIGLU,
    _case,
    _interpreter_cases,
    check_blocks_past_the_padded_count_exit,
    compare_fused,
    compare_grouping,
)
from tests.kernels._triton_interpreter import interpreted_test, needs_triton


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


test_triton_grouping_matches_reference_in_interpreter = interpreted_test(
    compare_grouping.__code__.co_filename,
    compare_grouping.__name__,
    kwargs={
        "device": "cpu",
        "cases": [(1, 8, 2, 16), (17, 8, 4, 16), (40, 4, 2, 16), (300, 16, 4, 32)],
    },
)


test_triton_matches_reference_in_interpreter = interpreted_test(
    compare_fused.__code__.co_filename,
    compare_fused.__name__,
    kwargs={"device": "cpu", "cases": _interpreter_cases()},
)


test_blocks_past_the_padded_count_exit_in_interpreter = interpreted_test(
    check_blocks_past_the_padded_count_exit.__code__.co_filename,
    check_blocks_past_the_padded_count_exit.__name__,
    kwargs={"device": "cpu"},
)


def test_tile_config_grows_block_m_with_rows_per_expert() -> None:
    decode, prefill = tile_config(8, 128), tile_config(2048 * 8, 128)
    assert decode.block_m == 16 and prefill.block_m == 128
    assert tile_config(2048 * 4, 32, "mxfp4").block_m == 64  # dequantizing tiles: smaller
    assert tile_config(2048 * 4, 32, "fp8").block_n == 64
    assert tile_config(4, 32, "fp8").block_n == tile_config(4, 32, "mxfp4").block_n == 32
    assert max_num_blocks(8, 128, 16) == 8  # batch 1, top 8: at most one block per expert
