"""The fused MoE's two grouped GEMMs with the operands swapped: each program computes the
transposed tile, out.T[BLOCK_N, BLOCK_M] = w[cols, :] @ x[rows, :].T, so that the weights
are the left operand of `tl.dot`.

Why: on Hopper the left operand of a warpgroup MMA may come from registers while the right
one must sit in shared memory, and its M is at least 64. The weights of MXFP4 (and FP8)
experts are converted in registers, so as the left operand they can feed the tensor cores
without a trip through shared memory, and the grouped rows (a few per expert at decode)
become the MMA's N, which may be as small as 16, instead of a 64-row M padded from them.
Same arguments, grid, weight kinds and results as kernels/_moe_gemm.py (which documents
them); `TileConfig.swap_ab` picks these kernels.
"""

from __future__ import annotations

from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from kernels._moe_gemm import _block_rows, _mma, gated_activation
    from kernels.mxfp4 import mxfp4_dequant_rows

    @triton.jit
    def _weight_mma_t(
        acc,  # [BLOCK_N, BLOCK_M] float32
        x,  # [BLOCK_M, BLOCK_K] activations (multiplied transposed)
        w_ptr,  # this expert's [N, K] weights (or MXFP4 bytes [N, K // 2])
        scale_ptr,  # this expert's MXFP4 [N, K // 32] uint8; block FP8 [N blocks, K blocks]
        rows,  # [BLOCK_N] weight rows
        scale_rows,  # [BLOCK_N] block FP8: each row's block row
        row_ok,
        k_start,
        K,
        w_row_stride,
        scale_row_stride,
        WEIGHTS: tl.constexpr,
        MXFP4_HALVES: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """acc + w[rows, k_start : k_start + BLOCK_K] @ x.T, block-scaled for WEIGHTS 3.
        MXFP4 tiles are multiplied as their even and odd columns against x's (two dots,
        MXFP4_HALVES) or interleaved back into one tile (one dot)."""
        if WEIGHTS == 1:
            byte_cols = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                w_ptr + rows[:, None] * w_row_stride + byte_cols[None, :],
                mask=row_ok[:, None] & (byte_cols[None, :] < K // 2),
                other=0,
            )
            groups = k_start // 32 + tl.arange(0, BLOCK_K // 32)
            scales = tl.load(
                scale_ptr + rows[:, None] * scale_row_stride + groups[None, :],
                mask=row_ok[:, None] & (groups[None, :] < K // 32),
                other=0,
            )
            even, odd = mxfp4_dequant_rows(packed, scales, x.dtype)
            if MXFP4_HALVES:
                x_even, x_odd = tl.split(tl.reshape(x, (x.shape[0], BLOCK_K // 2, 2)))
                acc = _mma(even, tl.trans(x_even), acc, PRECISION, UPCAST)
                return _mma(odd, tl.trans(x_odd), acc, PRECISION, UPCAST)
            else:
                w = tl.reshape(tl.join(even, odd), (even.shape[0], BLOCK_K))
                return _mma(w, tl.trans(x), acc, PRECISION, UPCAST)
        else:
            cols = k_start + tl.arange(0, BLOCK_K)
            w = tl.load(
                w_ptr + rows[:, None] * w_row_stride + cols[None, :],
                mask=row_ok[:, None] & (cols[None, :] < K),
                other=0.0,
            ).to(x.dtype)  # FP8: exact; its scales are applied to float32 sums
            if WEIGHTS == 3:
                scale = tl.load(
                    scale_ptr + scale_rows * scale_row_stride + k_start // 128,
                    mask=row_ok,
                    other=0.0,
                )
                part = _mma(w, tl.trans(x), tl.zeros_like(acc), PRECISION, UPCAST)
                return acc + part * scale[:, None]
            else:
                return _mma(w, tl.trans(x), acc, PRECISION, UPCAST)

    @triton.jit
    def _load_rows(row_ptrs, row_ok, k_start, K, BLOCK_K: tl.constexpr):
        """[BLOCK_M, BLOCK_K]: columns [k_start, k_start + BLOCK_K) of the rows."""
        ks = k_start + tl.arange(0, BLOCK_K)
        return tl.load(
            row_ptrs[:, None] + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0
        )

    @triton.jit
    def _scale_rows(acc, scale_ptr, rows, row_ok, WEIGHTS: tl.constexpr):
        """acc [BLOCK_N, BLOCK_M] times each weight row's per-channel scale (WEIGHTS 2)."""
        if WEIGHTS == 2:
            return acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
        else:
            return acc

    @triton.jit
    def _moe_gemm1_swapped_kernel(
        x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, sorted_ptr, block_expert_ptr,
        num_padded_ptr, num_pairs, N, K, x_row_stride, w_expert_stride, w_row_stride,
        scale_expert_stride, scale_row_stride, bias_expert_stride, alpha, limit,
        TOP_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        WEIGHTS: tl.constexpr,
        MXFP4_HALVES: tl.constexpr,
        ACTIVATION: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """_moe_gemm1_kernel's arguments and result, computed transposed."""
        if tl.program_id(0) * BLOCK_M < tl.load(num_padded_ptr):
            pairs, pair_ok, expert = _block_rows(sorted_ptr, block_expert_ptr, num_pairs, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            if WEIGHTS == 3:
                gate_scale_rows = cols // 128
                up_scale_rows = (N + 127) // 128 + cols // 128
            else:
                gate_scale_rows = cols
                up_scale_rows = N + cols
            w_expert = w_ptr + expert * w_expert_stride
            s_expert = scale_ptr + expert * scale_expert_stride
            gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            x_rows = x_ptr + (pairs // TOP_K) * x_row_stride
            for k_start in range(0, K, BLOCK_K):
                x = _load_rows(x_rows, pair_ok, k_start, K, BLOCK_K)
                gate = _weight_mma_t(
                    gate, x, w_expert, s_expert, cols, gate_scale_rows, col_ok, k_start, K,
                    w_row_stride, scale_row_stride, WEIGHTS, MXFP4_HALVES, BLOCK_K, PRECISION,
                    UPCAST_DOT,
                )  # fmt: skip
                up = _weight_mma_t(
                    up, x, w_expert, s_expert, N + cols, up_scale_rows, col_ok, k_start, K,
                    w_row_stride, scale_row_stride, WEIGHTS, MXFP4_HALVES, BLOCK_K, PRECISION,
                    UPCAST_DOT,
                )  # fmt: skip
            gate = _scale_rows(gate, s_expert, cols, col_ok, WEIGHTS)
            up = _scale_rows(up, s_expert, N + cols, col_ok, WEIGHTS)
            if HAS_BIAS:
                bias_row = bias_ptr + expert * bias_expert_stride
                gate += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
                up += tl.load(bias_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            act = gated_activation(gate, up, alpha, limit, ACTIVATION)
            tl.store(
                out_ptr + pairs[None, :] * N + cols[:, None],
                act.to(out_ptr.dtype.element_ty),
                mask=col_ok[:, None] & pair_ok[None, :],
            )

    @triton.jit
    def _moe_gemm2_swapped_kernel(
        a_ptr, w_ptr, scale_ptr, bias_ptr, route_w_ptr, out_ptr, sorted_ptr, block_expert_ptr,
        num_padded_ptr, num_pairs, N, K, w_expert_stride, w_row_stride, scale_expert_stride,
        scale_row_stride, bias_expert_stride,
        HAS_BIAS: tl.constexpr,
        WEIGHTS: tl.constexpr,
        MXFP4_HALVES: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """_moe_gemm2_kernel's arguments and result, computed transposed."""
        if tl.program_id(0) * BLOCK_M < tl.load(num_padded_ptr):
            pairs, pair_ok, expert = _block_rows(sorted_ptr, block_expert_ptr, num_pairs, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            if WEIGHTS == 3:
                scale_rows = cols // 128
            else:
                scale_rows = cols
            w_expert = w_ptr + expert * w_expert_stride
            s_expert = scale_ptr + expert * scale_expert_stride
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            a_rows = a_ptr + pairs * K
            for k_start in range(0, K, BLOCK_K):
                a = _load_rows(a_rows, pair_ok, k_start, K, BLOCK_K)
                acc = _weight_mma_t(
                    acc, a, w_expert, s_expert, cols, scale_rows, col_ok, k_start, K,
                    w_row_stride, scale_row_stride, WEIGHTS, MXFP4_HALVES, BLOCK_K, PRECISION,
                    UPCAST_DOT,
                )  # fmt: skip
            acc = _scale_rows(acc, s_expert, cols, col_ok, WEIGHTS)
            if HAS_BIAS:
                bias_row = bias_ptr + expert * bias_expert_stride
                acc += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            route_w = tl.load(route_w_ptr + pairs, mask=pair_ok, other=0.0)
            tl.store(
                out_ptr + pairs[None, :] * N + cols[:, None],
                (acc * route_w[None, :]).to(out_ptr.dtype.element_ty),
                mask=col_ok[:, None] & pair_ok[None, :],
            )
