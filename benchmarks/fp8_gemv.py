"""FP8 GEMV timing at the batch-1 projections of an FP8 model, each kernel checked against
its torch reference first: the weight-only kernel (kernels/fp8_gemv.py, `w8a16`, what the
model runs), the kernel that quantizes x itself and multiplies e4m3 by e4m3
(kernels/fp8_gemv_w8a8.py, `w8a8`), and cuBLAS on the same weights in bf16 (`bf16`: the
bandwidth a well-fed GEMV reaches; it reads twice the bytes).

    python -m benchmarks.fp8_gemv [--model llama-3.1-8b|qwen3-32b] [--tokens 1]
        [--kernels w8a16,w8a8,bf16] [--sweep [w8a16,w8a8]]

Each projection's weights come in enough copies to fill LAYER_BYTES, and one timed call runs
the GEMV once on every copy in turn, as a decode step runs one layer after another: the
weights are read from HBM, not from the 50 MB L2 cache that one repeated matrix would sit
in. Reported per GEMV and kernel: microseconds (CUDA-graph replay, the runner's way) and the
weight bytes read per second against the H200's copy bandwidth; the kernels of one
projection are timed one after another, so they see the same machine. `--sweep` also times
a grid of tiles (block_n, block_k, split_k, warps) of the FP8 kernels it names (both). On
the CPU the torch references run on small shapes (a check that the script runs, not a
figure).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch

from benchmarks import recording
from benchmarks.kernel_timing import PEAK_BYTES_PER_S, default_device, time_call
from kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_config, fp8_gemv_triton
from kernels.fp8_gemv_w8a8 import fp8_gemv_w8a8, fp8_gemv_w8a8_triton, w8a8_gemv_config
from kernels.fp8_quant import FP8_DTYPE

SHAPES = {  # projection: (N, K), per decoder layer
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                     "down": (4096, 14336)},
    "qwen3-32b": {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120),
                  "down": (5120, 25600)},
}  # fmt: skip
CPU_SHAPES = {"qkv": (96, 64), "down": (64, 160)}
LAYER_BYTES = 256 * 2**20
"""Weight bytes cycled through per timed call (the H100's and H200's L2 hold 50 MB)."""
MAX_REL_ERR = 2e-2
"""Largest error against the kernel's own reference, over the output's largest value."""
MAX_W8A8_DRIFT = 0.1
"""Largest error of the W8A8 product against the weight-only one (x's e4m3 rounding)."""
KERNELS = ("w8a16", "w8a8", "bf16")
SWEEP = {  # kernel: (block_n, block_k) pairs; split_k and warps vary around the default
    "w8a16": tuple(itertools.product((16, 32, 64), (128, 256, 512))),
    # Below 64 rows the e4m3 x e4m3 product is no warpgroup MMA: Triton converts both
    # operands for mma.sync (benchmarks.fp8_gemv_compile).
    "w8a8": tuple(itertools.product((64, 128), (128,))),
}
SWEEP_WARPS = (4, 8)


def _weights(num_out: int, depth: int, num_copies: int, device: str) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(num_out, depth, generator=g) * depth**-0.5).to(device)
    scale = w.abs().amax(dim=1) / 448.0
    w_fp8 = (w / scale[:, None]).to(FP8_DTYPE)
    return [(w_fp8.clone(), scale.float().clone()) for _ in range(num_copies)]


def _fp8_call(kernel: str, x, copies, device: str, config: Fp8GemvConfig | None):
    """One timed call: the kernel once on every weight copy (the launcher with `config` on
    CUDA, the dispatching function, i.e. the reference, on the CPU)."""
    if kernel == "w8a16":
        gemv = fp8_gemv_triton if device == "cuda" else fp8_gemv
    else:
        gemv = fp8_gemv_w8a8_triton if device == "cuda" else fp8_gemv_w8a8
    extra = {"config": config} if device == "cuda" else {}

    def call() -> None:
        for w, scale in copies:
            gemv(x, w, scale, **extra)

    return call


def _bf16_call(x, copies):
    dense = [(w.to(x.dtype) * scale[:, None].to(x.dtype)).contiguous() for w, scale in copies]

    def call() -> None:
        for w in dense:
            torch.nn.functional.linear(x, w)

    return call


def _timed(call, num_copies: int, device: str, weight_bytes: int) -> dict[str, float]:
    timing = time_call(call, device, repeats=3)
    best_ms = min(timing.values()) / num_copies
    return {
        "us": round(1e3 * best_ms, 2),
        "weight_tb_per_s": weight_bytes / best_ms / 1e9,
        "fraction_of_peak": weight_bytes / best_ms / 1e-3 / PEAK_BYTES_PER_S,
    }


def _default_config(kernel: str, num_tokens: int, num_out: int, depth: int) -> Fp8GemvConfig:
    if kernel == "w8a8":
        return w8a8_gemv_config(num_tokens, num_out, depth)
    return fp8_gemv_config(num_tokens, num_out, depth)


def _sweep_configs(kernel: str, default: Fp8GemvConfig) -> list[Fp8GemvConfig]:
    splits = sorted({max(1, default.split_k // 2), default.split_k, default.split_k * 2})
    grid = itertools.product(SWEEP[kernel], splits, SWEEP_WARPS)
    return [Fp8GemvConfig(n, k, split, warps) for (n, k), split, warps in grid]


def _check(name: str, x, w, scale) -> dict[str, float]:
    """Each FP8 kernel against its reference; the W8A8 product's drift from the weight-only
    one (what quantizing x costs)."""
    exact = (x.float() @ (w.float() * scale[:, None]).T).float()
    w8a8_ref = fp8_gemv_w8a8(x.float().cpu(), w.cpu(), scale.cpu()).to(x.device)
    errors = {}
    for kernel, got, ref in (
        ("w8a16", fp8_gemv(x, w, scale), exact),
        ("w8a8", fp8_gemv_w8a8(x, w, scale), w8a8_ref),
    ):
        errors[f"{kernel}_max_rel_err_vs_ref"] = _rel_err(got, ref)
        if not errors[f"{kernel}_max_rel_err_vs_ref"] <= MAX_REL_ERR:
            raise SystemExit(f"{kernel} {name} disagrees with its reference: {errors}")
    errors["w8a8_drift_from_w8a16"] = _rel_err(fp8_gemv_w8a8(x, w, scale), exact)
    if not errors["w8a8_drift_from_w8a16"] <= MAX_W8A8_DRIFT:
        raise SystemExit(f"w8a8 {name} drifts from the unquantized product: {errors}")
    return errors


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.abs().max().clamp(min=1e-6))


def _projection(name, num_out, depth, num_tokens, device, sweep, kernels) -> dict[str, Any]:
    weight_bytes = num_out * depth
    num_copies = max(1, LAYER_BYTES // weight_bytes) if device == "cuda" else 2
    copies = _weights(num_out, depth, num_copies, device)
    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(num_tokens, depth, generator=g).to(device, dtype)
    row: dict[str, Any] = {"shape": [num_out, depth], **_check(name, x, *copies[0])}
    for kernel in kernels:
        if kernel == "bf16":
            row[kernel] = _timed(_bf16_call(x, copies), num_copies, device, 2 * weight_bytes)
            continue
        default = _default_config(kernel, num_tokens, num_out, depth)
        call = _fp8_call(kernel, x, copies, device, None)
        row[kernel] = {
            "config": default._asdict(),
            **_timed(call, num_copies, device, weight_bytes),
        }
        if kernel in sweep and device == "cuda":
            row[kernel]["sweep"] = [
                _sweep_point(kernel, x, copies, config, weight_bytes)
                for config in _sweep_configs(kernel, default)
            ]
    return row


def _sweep_point(kernel, x, copies, config: Fp8GemvConfig, weight_bytes: int) -> dict[str, Any]:
    try:
        call = _fp8_call(kernel, x, copies, "cuda", config)
        return {**config._asdict(), **_timed(call, len(copies), "cuda", weight_bytes)}
    except Exception as error:  # noqa: BLE001 - e.g. out of registers
        return {**config._asdict(), "error": str(error)[:200]}


def main(argv: list[str] | None = None) -> int:
    p = recording.parser("fp8_gemv", __doc__)
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=1, help="rows of x (the GEMV serves 1-16)")
    p.add_argument("--device", default=default_device())
    p.add_argument("--kernels", default=",".join(KERNELS), help="some of " + ",".join(KERNELS))
    p.add_argument(
        "--sweep", nargs="?", const=",".join(SWEEP), default="", metavar="KERNELS",
        help="CUDA: also time a grid of tiles of these FP8 kernels (no list: both)",
    )  # fmt: skip
    args = p.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    if not kernels or set(kernels) - set(KERNELS):
        p.error(f"--kernels takes some of {', '.join(KERNELS)}, got {args.kernels!r}")
    swept = [k for k in args.sweep.split(",") if k]
    if set(swept) - set(SWEEP):
        p.error(f"--sweep takes some of {', '.join(SWEEP)}, got {args.sweep!r}")
    shapes = SHAPES[args.model] if args.device == "cuda" else CPU_SHAPES
    run = recording.Run(
        "fp8_gemv",
        args,
        f"fp8_gemv_{args.model.replace('.', '_').replace('-', '_')}"
        + ("" if args.device == "cuda" else "_cpu"),
        {
            "model": args.model,
            "tokens": args.tokens,
            "device": args.device,
            "shapes": shapes,
            "kernels": kernels,
        },
        argv,
    )
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {"peak_bytes_per_s": PEAK_BYTES_PER_S, "projections": {}}
    for name, (num_out, depth) in shapes.items():
        row = _projection(name, num_out, depth, args.tokens, args.device, swept, kernels)
        details["projections"][name] = row
        for kernel in kernels:  # the model's kernel keeps the figure's old name
            figures[f"{name}_us" if kernel == "w8a16" else f"{name}_{kernel}_us"] = row[kernel][
                "us"
            ]
            best = min(row[kernel].get("sweep", []), key=lambda r: r.get("us", float("inf")),
                       default=None)  # fmt: skip
            print(f"{args.model} {name} {num_out}x{depth} {kernel}: {row[kernel]['us']} us "
                  f"{row[kernel]['weight_tb_per_s']:.2f} TB/s"
                  + (f"; best {best}" if best else ""), flush=True)  # fmt: skip
        run.checkpoint(details)
    run.finish(figures, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
