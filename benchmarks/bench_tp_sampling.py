"""Batch-sharded vs all-gathered sampling across tensor-parallel ranks: peak logits
memory per rank and sampling time.

Every rank holds [B, V / N] bfloat16 logits, as the vocab-parallel LM head leaves them,
and samples the step two ways (gpu/sampling/batch_shard.py):
- sharded: all-to-all to [ceil(B / N), V] full-vocabulary rows, sample those, all-gather
  the tokens (and logprob rows);
- gathered: all-gather to [B, V] and sample every row on every rank.
Correctness first: for every (N, V, B, params) both must give exactly the tokens,
logprobs and ranks of one-device sampling of the same logits; a mismatch fails the rank,
and the run, before any timing. Then per rank: the peak memory allocated during one call
above what existed before it (torch.cuda.max_memory_allocated; the local logits shard is
not counted), and the median time of --iters calls after --warmup (CUDA events, the
collectives included). The table shows the worst rank.

    python benchmarks/bench_tp_sampling.py --out $OUT/tp_sampling.json
    python benchmarks/bench_tp_sampling.py --device cpu --tp 2 --vocab 1000 --batch 1,7 \
        --iters 2 --warmup 1            # a correctness smoke test over gloo
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._tp_bench import (  # noqa: E402
    StepTimer,
    header,
    join_group,
    run_ranks,
    synchronize,
    usable_tp_sizes,
)

from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from gpu.distributed.communicator import Communicator  # noqa: E402
from gpu.models.parallel_layers import vocab_shard  # noqa: E402
from gpu.sampling.batch_shard import AllGatherSampler, BatchShardedSampler  # noqa: E402
from gpu.sampling.sampler import Sampler, SamplerOutput  # noqa: E402
from gpu.sampling.state import SamplingState  # noqa: E402

PARAMS: dict[str, tuple[SamplingParams, int | None]] = {
    # What vLLM's throughput benchmark asks for: T = 1, top-p 1 (seeded Gumbel only).
    "temperature1": (SamplingParams(temperature=1.0), None),
    "top_p_logprobs5": (SamplingParams(temperature=0.8, top_p=0.9, logprobs=5), 5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tp_sampling.json"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tp", default="2,4", help="TP sizes (comma-separated)")
    parser.add_argument("--vocab", default="128256,151936", help="vocabulary sizes")
    parser.add_argument("--batch", default="1,64,256,1024", help="batch sizes (logit rows)")
    parser.add_argument("--params", default=",".join(PARAMS), help=f"of {', '.join(PARAMS)}")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    workload = {"vocab": _ints(args.vocab), "batch": _ints(args.batch),
                "params": args.params.split(","), "iters": args.iters, "warmup": args.warmup,
                "device": args.device}
    tp_sizes, skipped = usable_tp_sizes(_ints(args.tp), args.device)
    rows = []
    for tp_size in tp_sizes:
        per_rank = run_ranks(rank_main, tp_size, workload)
        rows += _merge_ranks(tp_size, per_rank)
    record = {**header("tp_sampling"), "workload": workload, "skipped_tp_sizes": skipped,
              "correctness": "every case matched one-device sampling exactly", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    _print_table(rows, skipped)
    print(f"wrote {args.out}")


def rank_main(rank: int, tp_size: int, init_method: str, workload: dict[str, Any]
              ) -> list[dict[str, Any]]:
    group = join_group(rank, tp_size, init_method, workload["device"])
    try:
        comm = Communicator(group)
        results = []
        for vocab_size in workload["vocab"]:
            for batch in workload["batch"]:
                for name in workload["params"]:
                    results.append(_one_case(comm, vocab_size, batch, name, workload))
        return results
    finally:
        group.close()


def _one_case(comm: Communicator, vocab_size: int, batch: int, params_name: str,
              workload: dict[str, Any]) -> dict[str, Any]:
    device = comm.device
    params, max_num_logprobs = PARAMS[params_name]
    state = SamplingState(batch, vocab_size, device)
    for row in range(batch):
        state.add_request(row, params.replace(seed=row), [1, 2, 3], [], [0], row)
    rows_np = np.arange(batch, dtype=np.int32)
    call_args = (torch.from_numpy(rows_np).to(device), rows_np,
                 torch.full((batch,), 1000, dtype=torch.int64, device=device),
                 torch.zeros(batch, dtype=torch.int32, device=device), max_num_logprobs)
    full = _logits(batch, vocab_size, device)
    expected = Sampler(state)(full.float(), *call_args)
    shard = vocab_shard(vocab_size, comm.rank, comm.world_size)
    local = torch.zeros(batch, shard.num_rows, dtype=full.dtype, device=device)
    local[:, :shard.num_real_rows] = full[:, shard.start:shard.start + shard.num_real_rows]
    del full
    sharded = BatchShardedSampler(Sampler(state), comm)
    local_owner_major = local[sharded.logits_row_order(batch)]
    gathered = AllGatherSampler(Sampler(state), comm)
    calls = {"sharded": lambda: sharded(local_owner_major, *call_args),
             "gathered": lambda: gathered(local, *call_args)}
    result = {"vocab": vocab_size, "batch": batch, "params": params_name,
              "local_logits_mib": local.numel() * local.element_size() / 2**20}
    for mode, call in calls.items():
        _check_same(call(), expected, f"{mode} V={vocab_size} B={batch} {params_name}")
        result[mode] = _measure(call, device, workload["iters"], workload["warmup"])
    return result


def _logits(batch: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The same [batch, vocab] bfloat16 logits on every rank."""
    generator = torch.Generator(device=device).manual_seed(batch * 7919 + vocab_size)
    logits = torch.randn(batch, vocab_size, generator=generator, device=device) * 3.0
    return logits.to(torch.bfloat16)


def _check_same(got: SamplerOutput, expected: SamplerOutput, what: str) -> None:
    for field in ("sampled_token_ids", "logprob_token_ids", "logprobs", "sampled_ranks"):
        got_value, expected_value = getattr(got, field), getattr(expected, field)
        if (got_value is None) != (expected_value is None) or (
                expected_value is not None and not torch.equal(got_value, expected_value)):
            raise AssertionError(f"{what}: {field} differs from one-device sampling")


def _measure(call: Any, device: torch.device, iters: int, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        call()
    synchronize(device)
    peak_mib = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    timer = StepTimer(device)
    for _ in range(iters):
        timer.start()
        call()
        timer.stop()
    return {"peak_mib": peak_mib, **timer.summary()}


def _merge_ranks(tp_size: int, per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    merged = []
    for cases in zip(*per_rank, strict=True):
        row = {"tp": tp_size, **{k: cases[0][k] for k in ("vocab", "batch", "params",
                                                           "local_logits_mib")}}
        for mode in ("sharded", "gathered"):
            peaks = [case[mode]["peak_mib"] for case in cases]
            row[mode] = {"median_ms_worst_rank": max(case[mode]["median_ms"] for case in cases),
                         "p90_ms_worst_rank": max(case[mode]["p90_ms"] for case in cases),
                         "peak_mib_per_rank": peaks,
                         "peak_mib_worst_rank": None if None in peaks else max(peaks)}
        merged.append(row)
    return merged


def _print_table(rows: list[dict[str, Any]], skipped: dict[int, str]) -> None:
    print(f"{'tp':>3} {'vocab':>7} {'batch':>5} {'params':<16} {'sharded ms':>10} "
          f"{'gathered ms':>11} {'sharded MiB':>11} {'gathered MiB':>12}")
    for row in rows:
        s, g = row["sharded"], row["gathered"]
        print(f"{row['tp']:>3} {row['vocab']:>7} {row['batch']:>5} {row['params']:<16} "
              f"{s['median_ms_worst_rank']:>10.3f} {g['median_ms_worst_rank']:>11.3f} "
              f"{_mib(s['peak_mib_worst_rank']):>11} {_mib(g['peak_mib_worst_rank']):>12}")
    for tp_size, why in skipped.items():
        print(f"tp {tp_size} skipped: {why}")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


if __name__ == "__main__":
    main()
