"""What one pass of the sampling-threshold search costs, part by part, on a CUDA device:
stand-alone kernels with the search's own grid (rows x 8192-token chunks), blocks and
device functions, each doing part of a pass over 256 x 151,936 float32 logits (randn):

    read         the statistics pass as shipped (max, min, sums): a plain read
    copy         a copy-out as shipped: the bracket's tokens take slots by atomics, each
                 block's stores wait for its atomics, plus the pass's totals
    copy_later   the same, each block's stores issued one block later (the atomics'
                 latency hidden behind the next block's load)
    totals       the totals alone (no copy)
    histogram    a histogram pass as shipped (126 bins + the totals)
    bins_only    the histogram without the totals
    copy_gated   the copy, its atomics skipped in blocks with no token in the bracket (a
                 block-wide count first)
    copy_scan    one atomic per block for the block's count, each token's slot from a
                 block-wide cumulative sum

    python3 benchmarks/threshold_pass_variants.py --out $OUT/threshold_pass_variants.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import _threshold_bins as bins  # noqa: E402
from kernels import _threshold_search as search  # noqa: E402
from kernels import sampling_thresholds as thresholds  # noqa: E402
from kernels.sampling_thresholds import BLOCK, CHUNK  # noqa: E402


@triton.jit
def _variant_kernel(logits_ptr, stride, bounds_ptr, partials_ptr, bins_ptr, cand_ptr, count_ptr,
                    vocab_size, VARIANT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, vocab_size)
    lo = tl.load(bounds_ptr + row * 4)
    hi = tl.load(bounds_ptr + row * 4 + 1)
    row_max = tl.load(bounds_ptr + row * 4 + 2)
    inv_width = tl.load(bounds_ptr + row * 4 + 3)
    partials = partials_ptr + (row * tl.num_programs(1) + chunk) * search.ROW_P
    in_cnt, in_mass, in_min, in_max, up_cnt, up_mass = search.zero_totals(BLOCK)
    counts = tl.zeros([search.BINS], tl.int32)
    counter = count_ptr + row + tl.zeros([BLOCK], tl.int32)
    cands = cand_ptr + row * search.CAP
    last_slot = tl.zeros([BLOCK], tl.int32)
    last_y = tl.zeros([BLOCK], tl.float32)
    last_in = tl.zeros([BLOCK], tl.int1)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        y, inside, above, mass = search.bracket_block(row_ptr, cols, end, 1.0, row_max, lo, hi)
        if VARIANT == 1:  # copy
            slot = tl.atomic_add(counter, 1, mask=inside, sem="relaxed")
            tl.store(cands + slot, y, mask=inside & (slot < search.CAP))
        if VARIANT == 2:  # copy_later
            tl.store(cands + last_slot, last_y, mask=last_in & (last_slot < search.CAP))
            last_slot = tl.atomic_add(counter, 1, mask=inside, sem="relaxed")
            last_y = y
            last_in = inside
        if VARIANT == 6:  # copy_gated
            if tl.sum(inside.to(tl.int32), axis=0) > 0:
                slot = tl.atomic_add(counter, 1, mask=inside, sem="relaxed")
                tl.store(cands + slot, y, mask=inside & (slot < search.CAP))
        if VARIANT == 7:  # copy_scan
            num_inside = tl.sum(inside.to(tl.int32), axis=0)
            if num_inside > 0:
                base = tl.atomic_add(count_ptr + row, num_inside, sem="relaxed")
                slot = base + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                tl.store(cands + slot, y, mask=inside & (slot < search.CAP))
        if (VARIANT == 4) | (VARIANT == 5):  # histogram, bins_only
            counts += tl.histogram(bins.bin_of(y, lo, hi, inv_width), search.BINS)
        if VARIANT != 5:
            in_cnt, in_mass, in_min, in_max, up_cnt, up_mass = search.add_totals(
                in_cnt, in_mass, in_min, in_max, up_cnt, up_mass, y, inside, above, mass)
    if VARIANT == 2:
        tl.store(cands + last_slot, last_y, mask=last_in & (last_slot < search.CAP))
    if (VARIANT == 4) | (VARIANT == 5):
        tl.store(bins_ptr + (row * tl.num_programs(1) + chunk) * search.BINS
                 + tl.arange(0, search.BINS), counts)
    search.store_totals(partials, in_cnt, in_mass, in_min, in_max, up_cnt, up_mass)


VARIANTS = {"read": -1, "copy": 1, "copy_later": 2, "totals": 3, "histogram": 4, "bins_only": 5,
            "copy_gated": 6, "copy_scan": 7}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--bracket-tokens", type=int, default=1000,
                        help="tokens per row in the copy's bracket (below the 50 largest)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, device="cuda") * 3
    top = torch.topk(logits, 50 + args.bracket_tokens, dim=1).values
    row_max = top[:, 0]
    hi, lo = top[:, 49], top[:, -1]
    inv_width = 126.0 / (row_max - lo)
    bounds = torch.stack([lo, hi, row_max, inv_width], dim=1).contiguous()
    num_chunks = triton.cdiv(args.vocab, CHUNK)
    partials = torch.zeros(args.rows * num_chunks * search.NUM_PARTIALS, device="cuda")
    bin_counts = torch.zeros(args.rows * num_chunks * search.NUM_BINS, dtype=torch.int32, device="cuda")
    candidates = torch.zeros(args.rows * search.CAPACITY, device="cuda")
    counter = torch.zeros(args.rows, dtype=torch.int32, device="cuda")

    stats = torch.empty(args.rows * num_chunks * 8, device="cuda")
    rows = torch.arange(args.rows, dtype=torch.int32, device="cuda")
    ones = torch.ones(args.rows, device="cuda")
    top_k = torch.full((args.rows,), 50, dtype=torch.int32, device="cuda")

    def launch(variant: int) -> None:
        counter.zero_()
        if variant < 0:
            thresholds._stats_kernel[(args.rows, num_chunks)](
                logits, logits.stride(0), rows, ones, top_k, ones, ones * 0, stats, args.vocab,
                CHUNK=CHUNK, BLOCK=BLOCK, NUM_STATS=8)
            return
        _variant_kernel[(args.rows, num_chunks)](
            logits, logits.stride(0), bounds, partials, bin_counts, candidates, counter,
            args.vocab, VARIANT=variant, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)

    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    checks = {}
    for name, variant in VARIANTS.items():
        launch(variant)
        torch.cuda.synchronize()
        if name.startswith("copy"):
            count = counter[0].item()
            got = torch.sort(candidates[:min(count, search.CAPACITY)]).values
            want = torch.sort(logits[0][(logits[0] > lo[0]) & (logits[0] <= hi[0])]).values
            checks[name] = {"count": count, "equal": bool(torch.equal(got, want[:len(got)]))
                            and count == len(want)}
    for _ in range(args.repeats):  # interleaved
        for name, variant in VARIANTS.items():
            zero_us = triton.testing.do_bench(counter.zero_, warmup=5, rep=50) * 1e3
            results[name].append(triton.testing.do_bench(lambda v=variant: launch(v), warmup=10,
                                                         rep=200) * 1e3 - zero_us)
    record = {"rows": args.rows, "vocab": args.vocab, "bracket_tokens": args.bracket_tokens,
              "device": torch.cuda.get_device_name(), "us": results,
              "median_us": {name: sorted(v)[len(v) // 2] for name, v in results.items()},
              "checks": checks}
    for name, us in record["median_us"].items():
        print(f"{name:12s} {us:8.1f} us")
    print(checks)
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
