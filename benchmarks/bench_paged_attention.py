"""Decode-path bandwidth of the Triton paged-attention kernel on a CUDA GPU.

Default workload: qwen3-0.6b attention (16 query heads, 8 kv heads, head_dim 128, bf16),
batch 256, every request at context 1024, block size 16 with shuffled blocks. Times the
kernel with triton.testing.do_bench (median) and reports the KV bytes read per second
against the H200's measured 4.26 TB/s copy bandwidth.

    python benchmarks/bench_paged_attention.py --out benchmarks/results/paged_attention.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.paged_attention import paged_attention_ref, paged_attention_triton  # noqa: E402

PEAK_TB_PER_S = 4.26


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/paged_attention.json"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="also time kv_tile_len x num_warps x num_stages")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_paged_attention needs a CUDA GPU")

    inputs = _decode_inputs(args)
    kv_bytes = 2 * args.batch * args.context * args.num_kv_heads * args.head_dim * inputs["query"].element_size()
    max_abs_err = _check_against_reference(inputs, args)
    default = _time_config(inputs, args, kv_bytes, {})
    print(_describe("default", default))
    sweep = []
    if args.sweep:
        for tile, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            knobs = {"kv_tile_len": tile, "num_warps": warps, "num_stages": stages}
            try:
                result = _time_config(inputs, args, kv_bytes, knobs)
            except Exception as error:  # e.g. out of shared memory for large tiles
                result = {**knobs, "error": f"{type(error).__name__}: {error}"[:200]}
            sweep.append(result)
            print(_describe(str(knobs), result))
    best = min((r for r in sweep if "median_ms" in r), key=lambda r: r["median_ms"], default=default)
    record = {
        "benchmark": "paged_attention_decode",
        "command": " ".join(sys.argv),
        "commit": os.environ.get("TANDEM_COMMIT") or _git_commit(),
        "hardware": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": {k: v for k, v in vars(args).items() if k not in ("out", "sweep")} | {"dtype": "bfloat16"},
        "kv_bytes_read": kv_bytes,
        "max_abs_err_vs_ref": max_abs_err,
        "peak_tb_per_s": PEAK_TB_PER_S,
        "default": default,
        "best": best,
        "sweep": sweep,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


def _decode_inputs(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_req = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_req + 1
    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    kv_cache = torch.randn((2, *cache_shape), generator=generator, device="cuda", dtype=torch.bfloat16)
    block_table = torch.randperm(num_blocks, generator=generator, device="cuda")[: args.batch * blocks_per_req]
    return {
        "query": torch.randn(
            (args.batch, args.num_heads, args.head_dim), generator=generator, device="cuda", dtype=torch.bfloat16
        ),
        "key_cache": kv_cache[0],
        "value_cache": kv_cache[1],
        "block_table": block_table.view(args.batch, blocks_per_req).int(),
        "seq_lens": torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda"),
        "query_start_loc": torch.arange(args.batch + 1, dtype=torch.int32, device="cuda"),
    }


def _run(inputs: dict[str, torch.Tensor], args: argparse.Namespace, knobs: dict[str, int]) -> torch.Tensor:
    return paged_attention_triton(
        **inputs, scale=args.head_dim**-0.5, max_query_len=1, max_seq_len=args.context, **knobs
    )


def _check_against_reference(inputs: dict[str, torch.Tensor], args: argparse.Namespace) -> float:
    out = _run(inputs, args, {})
    expected = paged_attention_ref(**inputs, scale=args.head_dim**-0.5)
    max_abs_err = (out.float() - expected.float()).abs().max().item()
    if max_abs_err > 2e-2:
        raise SystemExit(f"kernel disagrees with paged_attention_ref: max |diff| {max_abs_err:.3g}")
    return max_abs_err


def _time_config(
    inputs: dict[str, torch.Tensor], args: argparse.Namespace, kv_bytes: int, knobs: dict[str, int]
) -> dict[str, Any]:
    import triton.testing

    median_ms = triton.testing.do_bench(lambda: _run(inputs, args, knobs), warmup=25, rep=150, return_mode="median")
    tb_per_s = kv_bytes / (median_ms * 1e-3) / 1e12
    return {**knobs, "median_ms": median_ms, "tb_per_s": tb_per_s, "fraction_of_peak": tb_per_s / PEAK_TB_PER_S}


def _describe(label: str, result: dict[str, Any]) -> str:
    if "median_ms" not in result:
        return f"{label}: {result['error']}"
    return (
        f"{label}: {result['median_ms'] * 1e3:.1f} us, KV read {result['tb_per_s']:.2f} TB/s "
        f"= {100 * result['fraction_of_peak']:.1f}% of {PEAK_TB_PER_S} TB/s"
    )


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    main()
