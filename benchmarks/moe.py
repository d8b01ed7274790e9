"""Fused MoE layer timing (kernels/fused_moe.py): routing + fused experts at model shapes,
checked against the torch reference first.

    python -m benchmarks.moe [--model gpt-oss-20b|qwen3-30b-a3b] [--tokens 1,8,64,256,2048]
                             [--expert-dtype auto|bf16|fp8|fp8-channel] [--sweep]

On CUDA: eager and CUDA-graph medians of one MoE layer per token count, and the expert weight
bytes the call must read (each expert hit, once) against the H200's copy bandwidth: at small
token counts the layer is bound by those bytes. `--sweep` also times a grid of launch shapes
(block_m, block_n, block_k, warps, stages) at each token count, each checked against the
reference first, for choosing `tile_config`'s table. `--expert-dtype fp8` quantizes the experts
to e4m3 with 128x128 block scales (as Qwen3-30B-A3B-FP8 ships them; `fp8-channel`: per
output channel), which the kernels read weight-only; `auto` keeps the model's (bf16, or
gpt-oss's MXFP4); `bf16` gives gpt-oss bf16 experts too (what MXFP4's in-register
dequantization costs).
On the CPU the torch reference runs (a check that the script runs, not a figure to
compare).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch

from benchmarks import recording
from benchmarks.kernel_timing import PEAK_BYTES_PER_S, default_device, time_call
from kernels.fp8_experts import quantize_fp8_experts
from kernels.fused_moe import (
    MoEActivation,
    TileConfig,
    expert_format,
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    tile_config,
)
from kernels.moe_routing import moe_route
from kernels.mxfp4 import MXFP4Tensor, quantize_mxfp4

MODELS = {
    # hidden, intermediate, experts, top_k, mxfp4, activation
    "gpt-oss-20b": (2880, 2880, 32, 4, True, MoEActivation("swiglu_clamped")),
    "qwen3-30b-a3b": (2048, 768, 128, 8, False, MoEActivation("silu")),
}
MAX_REL_ERR = 2e-2
EXPERT_DTYPES = ("auto", "bf16", "fp8", "fp8-channel")
SWEEP = [
    TileConfig(*shape)
    for shape in (
        (16, 64, 128, 4, 4),
        (16, 32, 128, 4, 4),
        (16, 64, 256, 4, 3),
        (16, 128, 128, 4, 3),
        (32, 64, 128, 4, 4),
        (64, 64, 64, 4, 3),
        (64, 128, 64, 4, 3),
        (128, 64, 64, 8, 3),
        (128, 128, 64, 8, 3),
    )
]


def _weights(hidden, intermediate, num_experts, mxfp4, device, dtype, expert_dtype="auto"):
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) * intermediate**-0.5
    if expert_dtype.startswith("fp8"):
        block = expert_dtype == "fp8"
        return (
            quantize_fp8_experts(w13.to(device), block, num_row_parts=2),
            quantize_fp8_experts(w2.to(device), block),
        )
    if mxfp4:
        q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        return tuple(MXFP4Tensor(q.blocks.to(device), q.scales.to(device)) for q in (q13, q2))
    return w13.to(device, dtype), w2.to(device, dtype)


def _expert_bytes(hidden: int, intermediate: int, mxfp4: bool, expert_dtype: str) -> float:
    values = 3 * hidden * intermediate
    if expert_dtype.startswith("fp8"):
        return values * 1.0  # e4m3; the float32 scales add under 0.1%
    return values * 17 / 32 if mxfp4 else values * 2  # MXFP4: 4 bits + 1 scale byte / 32


def _bandwidth(timing: dict[str, float], weight_bytes: float) -> dict[str, float]:
    best_ms = min(timing.values())  # the graph replay where there is one
    return {
        **timing,
        "weight_tb_per_s": weight_bytes / best_ms / 1e9,
        "fraction_of_peak": weight_bytes / best_ms / 1e-3 / PEAK_BYTES_PER_S,
    }


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6))


def _sweep(layer_with_tile, ref: torch.Tensor, device: str) -> list[dict[str, Any]]:
    """Each tile shape's timing, and its output's error against the reference (a tile that
    computes wrong is reported, not timed as if it counted)."""
    rows = []
    for tile in SWEEP:
        knobs = dataclasses.asdict(tile)
        try:
            call = functools.partial(layer_with_tile, tile)
            rel_err = _rel_err(call(), ref)
            timing = time_call(call, device) if rel_err <= MAX_REL_ERR else {}
            rows.append({**knobs, **timing, "max_rel_err_vs_ref": rel_err})
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory
            rows.append({**knobs, "error": f"{type(error).__name__}: {error}"[:200]})
    return rows


def _measure(x, logits, top_k, experts, expert_bytes, args):
    """One token count: the layer checked against the reference and timed with the default
    tile (and the sweep's). Returns (its record, the default tile's timing)."""
    num_experts = logits.shape[1]

    def layer():
        weights, ids = moe_route(logits, top_k, True)
        return fused_moe(x, weights, ids, *experts)

    def layer_with_tile(tile):
        weights, ids = moe_route(logits, top_k, True)
        return fused_moe_triton(x, weights, ids, *experts, tile)

    weights, ids = moe_route(logits, top_k, True)
    ref = fused_moe_ref(x, weights, ids, *experts).float()
    rel_err = _rel_err(layer(), ref)
    if not rel_err <= MAX_REL_ERR:
        raise SystemExit(f"fused_moe disagrees with its reference: max rel err {rel_err:.3g}")
    weight_bytes = int(torch.unique(ids).numel()) * expert_bytes
    default = _bandwidth(time_call(layer, args.device), weight_bytes)
    row: dict[str, Any] = {
        "tile": dataclasses.asdict(
            tile_config(x.shape[0] * top_k, num_experts, expert_format(experts[0]))
        ),
        **default,
        "max_rel_err_vs_ref": rel_err,
    }
    if args.sweep and args.device == "cuda":
        row["sweep"] = _sweep(layer_with_tile, ref, args.device)
    return row, default


def main(argv: list[str] | None = None) -> int:
    p = recording.parser("moe", __doc__)
    p.add_argument("--model", default="gpt-oss-20b", choices=sorted(MODELS))
    p.add_argument("--tokens", default="1,8,64,256,2048")
    p.add_argument("--device", default=default_device())
    p.add_argument("--sweep", action="store_true", help="CUDA: also time a grid of tile shapes")
    p.add_argument(
        "--expert-dtype",
        default="auto",
        choices=EXPERT_DTYPES,
        help="auto: the model's experts (bf16, or MXFP4 for gpt-oss); bf16: bf16 experts "
        "for every model; fp8: e4m3 with 128x128 block scales; fp8-channel: e4m3 with "
        "per-output-channel scales",
    )
    args = p.parse_args(argv)
    hidden, intermediate, num_experts, top_k, mxfp4, activation = MODELS[args.model]
    expert_dtype = args.expert_dtype
    mxfp4 = mxfp4 and expert_dtype == "auto"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    token_counts = [int(t) for t in args.tokens.split(",")]
    run = recording.Run(
        "moe",
        args,
        f"moe_{args.model}"
        + ("" if expert_dtype == "auto" else f"_{expert_dtype.replace('-', '_')}")
        + ("" if args.device == "cuda" else "_cpu"),
        {
            "model": args.model,
            "expert_dtype": expert_dtype,
            "tokens": token_counts,
            "device": args.device,
            "dtype": str(dtype).removeprefix("torch."),
        },
        argv,
    )
    w13, w2 = _weights(hidden, intermediate, num_experts, mxfp4, args.device, dtype, expert_dtype)
    bias13 = torch.zeros(num_experts, 2 * intermediate, dtype=dtype, device=args.device)
    bias2 = torch.zeros(num_experts, hidden, dtype=dtype, device=args.device)
    g = torch.Generator().manual_seed(1)
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {"peak_bytes_per_s": PEAK_BYTES_PER_S}
    experts = (w13, w2, bias13, bias2, activation)
    expert_bytes = _expert_bytes(hidden, intermediate, mxfp4, expert_dtype)
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, hidden, generator=g).to(args.device, dtype)
        logits = torch.randn(num_tokens, num_experts, generator=g).to(args.device)
        row, default = _measure(x, logits, top_k, experts, expert_bytes, args)
        details[f"tokens_{num_tokens}"] = row
        best_ms = min(v for k, v in default.items() if k.endswith("median_ms"))
        figures[f"tokens_{num_tokens}_us"] = round(1e3 * best_ms, 1)
        print(
            f"{args.model} tokens={num_tokens} "
            + " ".join(f"{k}={v:.4g}" for k, v in default.items()),
            flush=True,
        )
        for sweep_row in row.get("sweep", []):
            print("   ", sweep_row, flush=True)
        run.checkpoint(details)
    run.finish(figures, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
