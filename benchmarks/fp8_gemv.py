"""FP8 weight-only GEMV timing (kernels/fp8_gemv.py) at the batch-1 projections of an FP8
model, each checked against the torch reference first.

    python -m benchmarks.fp8_gemv [--model llama-3.1-8b|qwen3-32b] [--tokens 1] [--sweep]

Each projection's weights come in enough copies to fill LAYER_BYTES, and one timed call runs
the GEMV once on every copy in turn, as a decode step runs one layer after another: the
weights are read from HBM, not from the 50 MB L2 cache that one repeated matrix would sit
in. Reported per GEMV: microseconds (CUDA-graph replay, the runner's way) and the weight
bytes read per second against the H200's copy bandwidth. `--sweep` also times a grid of
tiles (block_n, block_k, split_k, warps) for choosing `fp8_gemv_config`. On the CPU the
torch reference runs on small shapes (a check that the script runs, not a figure).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch

from benchmarks import recording
from benchmarks.kernel_timing import PEAK_BYTES_PER_S, default_device, time_call
from kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_config, fp8_gemv_triton
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
SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_BLOCK_K = (128, 256, 512)
SWEEP_WARPS = (4, 8)


def _weights(num_out: int, depth: int, num_copies: int, device: str) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(num_out, depth, generator=g) * depth**-0.5).to(device)
    scale = w.abs().amax(dim=1) / 448.0
    w_fp8 = (w / scale[:, None]).to(FP8_DTYPE)
    return [(w_fp8.clone(), scale.float().clone()) for _ in range(num_copies)]


def _sweep_configs(default: Fp8GemvConfig) -> list[Fp8GemvConfig]:
    splits = sorted({max(1, default.split_k // 2), default.split_k, default.split_k * 2})
    grid = itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, splits, SWEEP_WARPS)
    return [Fp8GemvConfig(*config) for config in grid]


def _time(copies, x, device: str, config: Fp8GemvConfig | None) -> dict[str, float]:
    if device == "cuda":

        def call() -> None:
            for w, scale in copies:
                fp8_gemv_triton(x, w, scale, config=config)
    else:

        def call() -> None:
            for w, scale in copies:
                fp8_gemv(x, w, scale)

    timing = time_call(call, device, repeats=3)
    return {key: value / len(copies) for key, value in timing.items()}


def _bandwidth(timing: dict[str, float], weight_bytes: int) -> dict[str, float]:
    best_ms = min(timing.values())
    return {
        "us": round(1e3 * best_ms, 2),
        "weight_tb_per_s": weight_bytes / best_ms / 1e9,
        "fraction_of_peak": weight_bytes / best_ms / 1e-3 / PEAK_BYTES_PER_S,
    }


def _projection(name, num_out, depth, num_tokens, device, sweep) -> dict[str, Any]:
    weight_bytes = num_out * depth
    num_copies = max(1, LAYER_BYTES // weight_bytes) if device == "cuda" else 2
    copies = _weights(num_out, depth, num_copies, device)
    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(num_tokens, depth, generator=g).to(device, dtype)
    w, scale = copies[0]
    ref = (x.float() @ (w.float() * scale[:, None]).T).float()
    out = fp8_gemv(x, w, scale).float()
    rel_err = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
    if not rel_err <= MAX_REL_ERR:
        raise SystemExit(f"fp8_gemv {name} disagrees with its reference: max rel err {rel_err:.3g}")
    default = fp8_gemv_config(num_tokens, num_out, depth)
    row: dict[str, Any] = {
        "shape": [num_out, depth],
        "config": default._asdict(),
        **_bandwidth(_time(copies, x, device, None), weight_bytes),
        "max_rel_err_vs_ref": rel_err,
    }
    if sweep and device == "cuda":
        row["sweep"] = []
        for config in _sweep_configs(default):
            try:
                timing = _time(copies, x, device, config)
                row["sweep"].append({**config._asdict(), **_bandwidth(timing, weight_bytes)})
            except Exception as error:  # noqa: BLE001 - e.g. out of registers
                row["sweep"].append({**config._asdict(), "error": str(error)[:200]})
    return row


def main(argv: list[str] | None = None) -> int:
    p = recording.parser("fp8_gemv", __doc__)
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=1, help="rows of x (the GEMV serves 1-16)")
    p.add_argument("--device", default=default_device())
    p.add_argument("--sweep", action="store_true", help="CUDA: also time a grid of tiles")
    args = p.parse_args(argv)
    shapes = SHAPES[args.model] if args.device == "cuda" else CPU_SHAPES
    run = recording.Run(
        "fp8_gemv",
        args,
        f"fp8_gemv_{args.model.replace('.', '_').replace('-', '_')}"
        + ("" if args.device == "cuda" else "_cpu"),
        {"model": args.model, "tokens": args.tokens, "device": args.device, "shapes": shapes},
        argv,
    )
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {"peak_bytes_per_s": PEAK_BYTES_PER_S, "projections": {}}
    for name, (num_out, depth) in shapes.items():
        row = _projection(name, num_out, depth, args.tokens, args.device, args.sweep)
        details["projections"][name] = row
        figures[f"{name}_us"] = row["us"]
        best = min(row.get("sweep", []), key=lambda r: r.get("us", float("inf")), default=None)
        print(f"{args.model} {name} {num_out}x{depth}: {row['us']} us "
              f"{row['weight_tb_per_s']:.2f} TB/s, default {row['config']}"
              + (f"; best {best}" if best else ""), flush=True)  # fmt: skip
        run.checkpoint(details)
    run.finish(figures, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
