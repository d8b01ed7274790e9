"""Decode-path bandwidth of paged attention (kernels/paged_attention.py): the Triton kernel on
CUDA, the torch reference elsewhere, checked against the reference first.

    python -m benchmarks.paged_attention [--sweep] [--sliding-window W] [--sinks]

Default workload: qwen3-0.6b attention (16 query heads, 8 kv heads, head_dim 128, bf16),
batch 256, every request at context 1024, block size 16 with shuffled blocks. The figure is
the KV bytes read per second against the H200's measured 4.26 TB/s copy bandwidth.
`--sweep` (CUDA) also times kv_tile_len x num_warps x num_stages. `--sliding-window W`
attends each decode to its last W keys only (the bytes counted are those keys), and
`--sinks` adds one learned sink logit per query head (gpt-oss).
"""

from __future__ import annotations

import functools
import itertools
import sys
from typing import Any

import torch

from benchmarks import recording
from benchmarks.kernel_timing import PEAK_BYTES_PER_S, default_device, time_call
from kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)

MAX_ABS_ERR = 2e-2


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("paged_attention", __doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default=default_device())
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--sinks", action="store_true", help="one sink logit per query head")
    p.add_argument(
        "--sweep", action="store_true", help="CUDA: also time kv_tile_len x num_warps x num_stages"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    workload = _workload(args)
    result_name = "paged_attention" if args.device == "cuda" else "paged_attention_cpu"
    run = recording.Run(
        "paged_attention",
        args,
        result_name,
        {**workload, "dtype": str(dtype).removeprefix("torch.")},
        argv,
    )
    inputs: dict[str, Any] = decode_inputs(args, dtype)
    kv_bytes = _kv_bytes_read(args, inputs["query"].element_size())
    scale = args.head_dim**-0.5
    generator = torch.Generator().manual_seed(1)
    sinks = torch.randn(args.num_heads, generator=generator).to(args.device) if args.sinks else None
    # only the options in use: the default workload runs on engines older than them (A/B)
    window_args = {
        k: v
        for k, v in (("sliding_window", args.sliding_window), ("sinks", sinks))
        if v is not None
    }

    def call(**knobs: Any) -> torch.Tensor:
        if knobs:
            return paged_attention_triton(
                **inputs, scale=scale, max_query_len=1, max_seq_len=args.context,
                **window_args, **knobs,
            )  # fmt: skip
        return paged_attention(
            **inputs, scale=scale, max_query_len=1, max_seq_len=args.context, **window_args
        )

    expected = paged_attention_ref(**inputs, scale=scale, **window_args)
    max_abs_err = (call().float() - expected.float()).abs().max().item()
    if not max_abs_err <= MAX_ABS_ERR:
        raise SystemExit(
            f"paged attention disagrees with its reference: max |diff| {max_abs_err:.3g}"
        )
    default = _bandwidth(time_call(call, args.device), kv_bytes)
    print(_describe("default", default))
    sweep = _sweep(call, kv_bytes, args.device) if args.sweep and args.device == "cuda" else []
    figures = {
        "median_us": round(1e3 * default["median_ms"], 2),
        "tb_per_s": round(default["tb_per_s"], 3),
        "fraction_of_peak": round(default["fraction_of_peak"], 4),
    }
    run.finish(
        figures,
        {
            "kv_bytes_read": kv_bytes,
            "max_abs_err_vs_ref": max_abs_err,
            "peak_bytes_per_s": PEAK_BYTES_PER_S,
            "default": default,
            "sweep": sweep,
        },
    )
    return 0


def _workload(args: Any) -> dict[str, Any]:
    names = ("batch", "context", "num_heads", "num_kv_heads", "head_dim", "block_size", "device")
    workload = {name: getattr(args, name) for name in names}
    if args.sliding_window is not None:
        workload["sliding_window"] = args.sliding_window
    if args.sinks:
        workload["sinks"] = True
    return workload


def _kv_bytes_read(args: Any, element_size: int) -> int:
    """Keys and values of every request's context (its window, for a sliding window)."""
    keys_read = min(args.context, args.sliding_window or args.context)
    return 2 * args.batch * keys_read * args.num_kv_heads * args.head_dim * element_size


def _sweep(call: Any, kv_bytes: int, device: str) -> list[dict[str, Any]]:
    """Each tile shape timed; a shape that fails (e.g. out of shared memory) says why."""
    sweep: list[dict[str, Any]] = []
    for tile, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        knobs: dict[str, Any] = {"kv_tile_len": tile, "num_warps": warps, "num_stages": stages}
        result: dict[str, Any]
        try:
            timing = time_call(functools.partial(call, **knobs), device)
            result = {**knobs, **_bandwidth(timing, kv_bytes)}
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory
            result = {**knobs, "error": f"{type(error).__name__}: {error}"[:200]}
        sweep.append(result)
        print(_describe(str(knobs), result))
    return sweep


def decode_inputs(args: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    device = args.device
    generator = torch.Generator(device=device).manual_seed(0)
    blocks_per_req = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_req + 1
    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    kv_cache = torch.randn((2, *cache_shape), generator=generator, device=device, dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=generator, device=device)[
        : args.batch * blocks_per_req
    ]
    return {
        "query": torch.randn(
            (args.batch, args.num_heads, args.head_dim),
            generator=generator,
            device=device,
            dtype=dtype,
        ),
        "key_cache": kv_cache[0],
        "value_cache": kv_cache[1],
        "block_table": block_table.view(args.batch, blocks_per_req).int(),
        "seq_lens": torch.full((args.batch,), args.context, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(args.batch + 1, dtype=torch.int32, device=device),
    }


def _bandwidth(timing: dict[str, float], kv_bytes: int) -> dict[str, float]:
    tb_per_s = kv_bytes / (timing["median_ms"] * 1e-3) / 1e12
    return {**timing, "tb_per_s": tb_per_s, "fraction_of_peak": tb_per_s * 1e12 / PEAK_BYTES_PER_S}


def _describe(label: str, result: dict[str, Any]) -> str:
    if "median_ms" not in result:
        return f"{label}: {result['error']}"
    return (
        f"{label}: {result['median_ms'] * 1e3:.1f} us, KV read {result['tb_per_s']:.2f} TB/s "
        f"= {100 * result['fraction_of_peak']:.1f}% of {PEAK_BYTES_PER_S / 1e12} TB/s"
    )


if __name__ == "__main__":
    sys.exit(main())
