"""One call of each FP8 GEMV kernel at one batch-1 projection, for Nsight Compute to read
the hardware counters of: what holds a GEMV below the HBM bandwidth (memory throughput,
stalls, occupancy), which the timings of benchmarks.fp8_gemv cannot say.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python3 -m benchmarks.fp8_gemv_ncu [--model llama-3.1-8b] [--projection gate_up]

(plan `fp8_gemv_ncu` in benchmarks/device_plan.sh). Each kernel (`w8a16`: kernels/fp8_gemv.py,
what the model runs; `bf16`: cuBLAS on the same weights in bf16, the yardstick; `w8a8`:
kernels/fp8_gemv_w8a8.py where this tree has it) runs a few times to compile and warm up,
then once inside an NVTX range named `profile` (ncu profiles only what that range holds,
the split-K sum included). gate/up's weights (117 MB for llama-3.1-8b) do not fit the 50 MB
L2, so the profiled call reads them from HBM. Not a result: the counters are in ncu's
output.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

import torch

from benchmarks.fp8_gemv import SHAPES, _weights
from kernels.fp8_gemv import fp8_gemv_triton

WARMUP_CALLS = 3


def _kernels(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> dict:
    """Kernel name -> a call of it on these weights."""
    dense = (w_fp8.to(torch.bfloat16) * w_scale[:, None].to(torch.bfloat16)).contiguous()
    kernels: dict[str, Callable[[], torch.Tensor]] = {
        "w8a16": lambda: fp8_gemv_triton(x, w_fp8, w_scale),
        "bf16": lambda: torch.nn.functional.linear(x, dense),
    }
    if importlib.util.find_spec("kernels.fp8_gemv_w8a8") is not None:
        from kernels.fp8_gemv_w8a8 import fp8_gemv_w8a8_triton

        kernels["w8a8"] = lambda: fp8_gemv_w8a8_triton(x, w_fp8, w_scale)
    return kernels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fp8_gemv_ncu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--projection", default="gate_up")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--results-dir", help="ignored: the counters are in ncu's output")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.fp8_gemv_ncu: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = SHAPES[args.model]
    if args.projection not in shapes:
        p.error(f"--projection takes one of {', '.join(shapes)}, got {args.projection!r}")
    num_out, depth = shapes[args.projection]
    ((w_fp8, w_scale),) = _weights(num_out, depth, 1, "cuda")  # benchmarks.fp8_gemv's
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, depth, generator=generator).bfloat16().cuda()
    for name, call in _kernels(x, w_fp8, w_scale).items():
        for _ in range(WARMUP_CALLS):
            call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"profiled {name}: {args.model} {args.projection} {num_out}x{depth}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
