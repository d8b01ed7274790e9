"""benchmarks.fp8_gemv_compile: the FP8 GEMV kernels compiled for Hopper on a machine
without a GPU. The W8A8 kernel's default tile must stay what it was written for: an e4m3 x
e4m3 warpgroup MMA with pipelined loads and no spills, converting only x and dividing by
a division subroutine only for the scales."""

from __future__ import annotations

import pytest

from benchmarks import fp8_gemv_compile
from kernels._triton import HAS_TRITON
from kernels.fp8_gemv_w8a8 import w8a8_gemv_config

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


@pytest.mark.parametrize("blockwise", [True, False])
def test_w8a8_default_tile_is_an_e4m3_warpgroup_mma(blockwise: bool) -> None:
    config = w8a8_gemv_config(1, 28672, 4096)
    compiled = fp8_gemv_compile.compile_variant("w8a8", config.block_n, blockwise, 4, 3)
    seen = fp8_gemv_compile.describe(compiled)
    assert seen["wgmma"] == ["m64n16k32.f32.e4m3.e4m3"] and seen["mma_sync"] == 0, seen
    assert seen["cp_async"] > 0 and seen["spill_store_bytes"] == 0, seen
    assert seen["cvt_e4m3"] <= 8, seen  # x's quantization only: the weights go in as they are
    assert seen["sass_calls"] <= 4, seen  # the scales' divisions; none per value


def test_a_narrow_w8a8_tile_falls_back_to_converting_both_operands() -> None:
    """Why the sweep and the default keep 64 weight rows or more."""
    seen = fp8_gemv_compile.describe(fp8_gemv_compile.compile_variant("w8a8", 32, True, 4, 3))
    assert seen["wgmma"] == [] and seen["mma_sync"] > 0 and seen["cvt_e4m3"] > 8, seen
