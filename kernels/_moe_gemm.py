"""The two grouped GEMMs of the fused MoE (kernels/fused_moe.py).

Each program owns one block of BLOCK_M grouped rows (one expert, see kernels/_moe_align.py)
and BLOCK_N output columns; a program whose block lies past the padded row count returns at
once. Weights are [num_experts, N, K] with K contiguous, either in the model dtype or in
MXFP4 (uint8 bytes [num_experts, N, K // 2] and group scales [num_experts, N, K // 32]),
which are dequantized in registers before `tl.dot` (Hopper has no FP4 tensor-core path).

GEMM 1: act(x @ w13[e, :I].T + b, x @ w13[e, I:].T + b) -> intermediate[pair] (model dtype)
GEMM 2: weight[pair] * (intermediate[pair] @ w2[e].T + b2) -> slot_out[pair]
"""

from __future__ import annotations

from kernels._triton import HAS_TRITON, tl, triton

ACT_SILU = 0
ACT_SWIGLU_CLAMPED = 1

if HAS_TRITON:
    from kernels.mxfp4 import mxfp4_dequant_nibbles

    @triton.jit
    def _load_rows(row_ptrs, row_ok, k_start, K, IS_MXFP4: tl.constexpr, BLOCK_K: tl.constexpr):
        """Columns [k_start, k_start + BLOCK_K) of the activation rows: as (even, odd) column
        halves for MXFP4, whose bytes hold an even and an odd column; else (tile, tile).
        The halves come from one contiguous load split in registers: two strided loads
        measured 1.1x (one token) to 5.6x (4,096 tokens) slower (benchmarks/NOTES.md)."""
        ks = k_start + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks[None, :] < K)
        tile = tl.load(row_ptrs[:, None] + ks[None, :], mask=mask, other=0.0)
        if IS_MXFP4:
            return tl.split(tl.reshape(tile, (tile.shape[0], BLOCK_K // 2, 2)))
        else:
            return tile, tile

    @triton.jit
    def _weight_mma(
        acc,  # [BLOCK_M, BLOCK_N] float32
        a0,  # _load_rows's pair
        a1,
        w_ptr,  # this expert's [N, K] weights (or [N, K // 2] bytes)
        scale_ptr,  # this expert's [N, K // 32] uint8 scales (MXFP4 only)
        rows,  # [BLOCK_N] weight rows
        row_ok,
        k_start,
        K,
        w_row_stride,
        scale_row_stride,
        IS_MXFP4: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """acc + a[:, k_start : k_start + BLOCK_K] @ w[rows, k_start : ...].T"""
        if IS_MXFP4:
            byte_cols = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            mask = (byte_cols[:, None] < K // 2) & row_ok[None, :]
            packed = tl.load(
                w_ptr + rows[None, :] * w_row_stride + byte_cols[:, None], mask=mask, other=0
            )
            groups = k_start // 32 + tl.arange(0, BLOCK_K // 32)
            scales = tl.load(
                scale_ptr + rows[None, :] * scale_row_stride + groups[:, None],
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
            return _mma(a0, w, acc, PRECISION, UPCAST)

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
    def _moe_gemm1_kernel(
        x_ptr,  # [num_tokens, K]
        w_ptr,  # [num_experts, 2 * N, K] (or MXFP4 bytes [num_experts, 2 * N, K // 2])
        scale_ptr,  # [num_experts, 2 * N, K // 32] uint8, MXFP4 only
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
        IS_MXFP4: tl.constexpr,
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
            w_expert = w_ptr + expert * w_expert_stride
            s_expert = scale_ptr + expert * scale_expert_stride
            gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            x_rows = x_ptr + tokens * x_row_stride
            for k_start in range(0, K, BLOCK_K):
                x0, x1 = _load_rows(x_rows, row_ok, k_start, K, IS_MXFP4, BLOCK_K)
                gate = _weight_mma(
                    gate, x0, x1, w_expert, s_expert, cols, col_ok, k_start, K, w_row_stride,
                    scale_row_stride, IS_MXFP4, BLOCK_K, PRECISION, UPCAST_DOT,
                )  # fmt: skip
                up = _weight_mma(
                    up, x0, x1, w_expert, s_expert, N + cols, col_ok, k_start, K, w_row_stride,
                    scale_row_stride, IS_MXFP4, BLOCK_K, PRECISION, UPCAST_DOT,
                )  # fmt: skip
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
        scale_ptr,  # [num_experts, N, K // 32] uint8, MXFP4 only
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
        IS_MXFP4: tl.constexpr,
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
            w_expert = w_ptr + expert * w_expert_stride
            s_expert = scale_ptr + expert * scale_expert_stride
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            a_rows = a_ptr + pairs * K
            for k_start in range(0, K, BLOCK_K):
                a0, a1 = _load_rows(a_rows, row_ok, k_start, K, IS_MXFP4, BLOCK_K)
                acc = _weight_mma(
                    acc, a0, a1, w_expert, s_expert, cols, col_ok, k_start, K, w_row_stride,
                    scale_row_stride, IS_MXFP4, BLOCK_K, PRECISION, UPCAST_DOT,
                )  # fmt: skip
            if HAS_BIAS:
                bias_row = bias_ptr + expert * bias_expert_stride
                acc += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            route_w = tl.load(route_w_ptr + pairs, mask=row_ok, other=0.0)
            tl.store(
                out_ptr + pairs[:, None] * N + cols[None, :],
                (acc * route_w[:, None]).to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )
