"""The two grouped GEMMs of the fused MoE (kernels/fused_moe.py).

Each program owns one block of BLOCK_M grouped rows (one expert, see kernels/_moe_align.py)
and BLOCK_N output columns; a program whose block lies past the padded row count returns at
once. Weights are [num_experts, N, K] with K contiguous, of one of four kinds (WEIGHTS):

  0  the model dtype;
  1  MXFP4: uint8 bytes [num_experts, N, K // 2] and group scales [num_experts, N, K // 32],
     dequantized in registers before `tl.dot` (Hopper has no FP4 tensor-core path);
  2  FP8 e4m3 with per-output-channel scales [num_experts, N] float32;
  3  FP8 e4m3 with 128x128 block scales [num_experts, N blocks, K blocks] float32
     (kernels/fp8_experts.py; GEMM 1's gate and up halves are blocked separately).

FP8 tiles are converted to the activations' dtype in registers, which is exact (every
e4m3 value is a bf16 and an fp16 value), and multiplied on the tensor cores with float32
accumulation; the scales multiply float32 sums, so they add no rounding to the operands:
per-channel scales the finished sums (once, after the K loop), block scales each K tile's
partial product (BLOCK_K divides 128, so a tile lies in one block column).

GEMM 1: act(x @ w13[e, :I].T + b, x @ w13[e, I:].T + b) -> intermediate[pair] (model dtype)
GEMM 2: weight[pair] * (intermediate[pair] @ w2[e].T + b2) -> slot_out[pair]
"""

from __future__ import annotations

from kernels._triton import HAS_TRITON, tl, triton

ACT_SILU = 0
ACT_SWIGLU_CLAMPED = 1
WEIGHTS_PLAIN, WEIGHTS_MXFP4, WEIGHTS_FP8_CHANNEL, WEIGHTS_FP8_BLOCK = 0, 1, 2, 3
"""The WEIGHTS kinds (the kernels compare literals: Triton reads no plain globals)."""

if HAS_TRITON:
    from kernels.mxfp4 import mxfp4_dequant_nibbles

    @triton.jit
    def _load_rows(row_ptrs, row_ok, k_start, K, WEIGHTS: tl.constexpr, BLOCK_K: tl.constexpr):
        """Columns [k_start, k_start + BLOCK_K) of the activation rows: as (even, odd) column
        halves for MXFP4, whose bytes hold an even and an odd column; else (tile, tile).
        The halves come from one contiguous load split in registers: two strided loads
        measured 1.1x (one token) to 5.6x (4,096 tokens) slower (benchmarks/NOTES.md)."""
        ks = k_start + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks[None, :] < K)
        tile = tl.load(row_ptrs[:, None] + ks[None, :], mask=mask, other=0.0)
        if WEIGHTS == 1:
            return tl.split(tl.reshape(tile, (tile.shape[0], BLOCK_K // 2, 2)))
        else:
            return tile, tile

    @triton.jit
    def _weight_mma(
        acc,  # [BLOCK_M, BLOCK_N] float32
        a0,  # _load_rows's pair
        a1,
        w_ptr,  # this expert's [N, K] weights (or [N, K // 2] bytes)
        scale_ptr,  # this expert's scales: [N, K // 32] uint8 (MXFP4), [N blocks, K blocks]
        rows,  # [BLOCK_N] weight rows
        scale_rows,  # [BLOCK_N] their scale rows (MXFP4: the rows; block FP8: their blocks)
        row_ok,
        k_start,
        K,
        w_row_stride,
        scale_row_stride,
        WEIGHTS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """acc + a[:, k_start : k_start + BLOCK_K] @ w[rows, k_start : ...].T, block-scaled
        for WEIGHTS 3 (per-channel scales are applied by the caller, after the K loop)."""
        if WEIGHTS == 1:
            byte_cols = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            mask = (byte_cols[:, None] < K // 2) & row_ok[None, :]
            packed = tl.load(
                w_ptr + rows[None, :] * w_row_stride + byte_cols[:, None], mask=mask, other=0
            )
            groups = k_start // 32 + tl.arange(0, BLOCK_K // 32)
            scales = tl.load(
                scale_ptr + scale_rows[None, :] * scale_row_stride + groups[:, None],
                mask=(groups[:, None] < K // 32) & row_ok[None, :],
                other=0,
            )
            low, high = mxfp4_dequant_nibbles(packed, scales, a0.dtype)
            acc = _mma(a0, low, acc, PRECISION, UPCAST)
            return _mma(a1, high, acc, PRECISION, UPCAST)
        else:
            cols = k_start + tl.arange(0, BLOCK_K)
            mask = (cols[:, None] < K) & row_ok[None, :]
            w = tl.load(w_ptr + rows[None, :] * w_row_stride + cols[:, None], mask=mask, other=0.0)
            if WEIGHTS == 0:
                return _mma(a0, w, acc, PRECISION, UPCAST)
            else:
                # e4m3 to the activations' dtype is exact; under UPCAST (the CPU
                # interpreter, whose dot takes float32) straight to float32
                if UPCAST:
                    w = w.to(tl.float32)
                else:
                    w = w.to(a0.dtype)
                if WEIGHTS == 2:
                    return _mma(a0, w, acc, PRECISION, UPCAST)
                else:
                    scale = tl.load(
                        scale_ptr + scale_rows * scale_row_stride + k_start // 128,
                        mask=row_ok,
                        other=0.0,
                    )
                    part = _mma(a0, w, tl.zeros_like(acc), PRECISION, UPCAST)
                    return acc + part * scale[None, :]

    @triton.jit
    def _mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b. UPCAST (Triton's CPU interpreter only): its dot multiplies bf16
        operands' raw bits, so they go in as float32, whose products of bf16 or fp16
        values are exact, as on the tensor cores."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _block_rows(sorted_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
        """(pair ids, valid rows, expert) of this program's block of grouped rows."""
        block = tl.program_id(0)
        pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        return pairs.to(tl.int64), pairs < num_pairs, expert

    @triton.jit
    def _channel_scale(acc, scale_ptr, rows, row_ok, WEIGHTS: tl.constexpr):
        """acc times the per-channel scale of each column's weight row (WEIGHTS 2 only)."""
        if WEIGHTS == 2:
            return acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
        else:
            return acc

    @triton.jit
    def _moe_gemm1_kernel(
        x_ptr,  # [num_tokens, K]
        w_ptr,  # [num_experts, 2 * N, K] (or MXFP4 bytes [num_experts, 2 * N, K // 2])
        scale_ptr,  # the weights' scales (WEIGHTS 1-3, see the module docstring)
        bias_ptr,  # [num_experts, 2 * N], HAS_BIAS only
        out_ptr,  # [num_pairs, N] model dtype
        sorted_ptr,
        block_expert_ptr,
        num_padded_ptr,
        num_pairs,
        N,
        K,
        x_row_stride,
        w_expert_stride,
        w_row_stride,
        scale_expert_stride,
        scale_row_stride,
        bias_expert_stride,
        alpha,
        limit,
        TOP_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        WEIGHTS: tl.constexpr,
        ACTIVATION: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # blocks past the padded row count hold no rows: exit before reading anything else
        if tl.program_id(0) * BLOCK_M < tl.load(num_padded_ptr):
            pairs, row_ok, expert = _block_rows(sorted_ptr, block_expert_ptr, num_pairs, BLOCK_M)
            tokens = pairs // TOP_K
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            if WEIGHTS == 3:  # the gate's block rows, then the up's
                gate_scale_rows = cols // 128
                up_scale_rows = (N + 127) // 128 + cols // 128
            else:
                gate_scale_rows = cols
                up_scale_rows = N + cols
            w_expert = w_ptr + expert * w_expert_stride
            s_expert = scale_ptr + expert * scale_expert_stride
            gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            x_rows = x_ptr + tokens * x_row_stride
            for k_start in range(0, K, BLOCK_K):
                x0, x1 = _load_rows(x_rows, row_ok, k_start, K, WEIGHTS, BLOCK_K)
                gate = _weight_mma(
                    gate, x0, x1, w_expert, s_expert, cols, gate_scale_rows, col_ok, k_start, K,
                    w_row_stride, scale_row_stride, WEIGHTS, BLOCK_K, PRECISION, UPCAST_DOT,
                )  # fmt: skip
                up = _weight_mma(
                    up, x0, x1, w_expert, s_expert, N + cols, up_scale_rows, col_ok, k_start, K,
                    w_row_stride, scale_row_stride, WEIGHTS, BLOCK_K, PRECISION, UPCAST_DOT,
                )  # fmt: skip
            gate = _channel_scale(gate, s_expert, cols, col_ok, WEIGHTS)
            up = _channel_scale(up, s_expert, N + cols, col_ok, WEIGHTS)
            if HAS_BIAS:
                bias_row = bias_ptr + expert * bias_expert_stride
                gate += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                up += tl.load(bias_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if ACTIVATION == 0:  # silu(gate) * up
                act = gate / (1.0 + tl.exp(-gate)) * up
            else:  # gpt-oss: clamped, (up + 1) * gate * sigmoid(alpha * gate)
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
            tl.store(
                out_ptr + pairs[:, None] * N + cols[None, :],
                act.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )

    @triton.jit
    def _moe_gemm2_kernel(
        a_ptr,  # [num_pairs, K] model dtype (GEMM 1's output)
        w_ptr,  # [num_experts, N, K] (or MXFP4 bytes [num_experts, N, K // 2])
        scale_ptr,  # the weights' scales (WEIGHTS 1-3, see the module docstring)
        bias_ptr,  # [num_experts, N], HAS_BIAS only
        route_w_ptr,  # [num_pairs] float32
        out_ptr,  # [num_pairs, N]
        sorted_ptr,
        block_expert_ptr,
        num_padded_ptr,
        num_pairs,
        N,
        K,
        w_expert_stride,
        w_row_stride,
        scale_expert_stride,
        scale_row_stride,
        bias_expert_stride,
        HAS_BIAS: tl.constexpr,
        WEIGHTS: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # blocks past the padded row count hold no rows: exit before reading anything else
        if tl.program_id(0) * BLOCK_M < tl.load(num_padded_ptr):
            pairs, row_ok, expert = _block_rows(sorted_ptr, block_expert_ptr, num_pairs, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            if WEIGHTS == 3:
                scale_rows = cols // 128
            else:
                scale_rows = cols
            w_expert = w_ptr + expert * w_expert_stride
            s_expert = scale_ptr + expert * scale_expert_stride
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            a_rows = a_ptr + pairs * K
            for k_start in range(0, K, BLOCK_K):
                a0, a1 = _load_rows(a_rows, row_ok, k_start, K, WEIGHTS, BLOCK_K)
                acc = _weight_mma(
                    acc, a0, a1, w_expert, s_expert, cols, scale_rows, col_ok, k_start, K,
                    w_row_stride, scale_row_stride, WEIGHTS, BLOCK_K, PRECISION, UPCAST_DOT,
                )  # fmt: skip
            acc = _channel_scale(acc, s_expert, cols, col_ok, WEIGHTS)
            if HAS_BIAS:
                bias_row = bias_ptr + expert * bias_expert_stride
                acc += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            route_w = tl.load(route_w_ptr + pairs, mask=row_ok, other=0.0)
            tl.store(
                out_ptr + pairs[:, None] * N + cols[None, :],
                (acc * route_w[:, None]).to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )
