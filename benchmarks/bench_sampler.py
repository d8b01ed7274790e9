"""Time the GPU sampler on a CUDA GPU, one sampling path at a time.

Default workload: batch 256 x vocab 151936 (Qwen3) float32 logits, 256 request rows.
Paths: greedy, temperature (T=0.8, seeded Gumbel-max), top-p alone (0.9), top-k + top-p
(50, 0.9), top-k alone (50), min-p alone (0.05), min-p + penalties, and temperature with
5 top logprobs. Each path is the whole Sampler call (host-side op selection included),
timed two ways with triton.testing.do_bench (median): eagerly, launches from Python
included, and as replays of a CUDA graph of the call (the device time, as the runner's
sampling graphs run it). `old_sort_top_p` times the previous sort-based top-p path for
comparison, and `sweep` the threshold search's chunk and block sizes on top-p.

First, the thresholds alone (benchmarks/_threshold_ab.py): top-p, top-k + top-p, min-p,
top-k and top-p 0.99 on Gaussian and peaked logits, each checked against the
sort-based reference (kept mass, batch invariance, graph == eager), then timed as graph
replays, interleaved with a baseline checkout's kernels: --baseline-root, by default the
checkout this one sits in (a copy of the branch in a folder of main's checkout), if any.

    python benchmarks/bench_sampler.py --out benchmarks/results/sampler.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _device_record import run_record, write_json  # noqa: E402
from _threshold_ab import run as run_threshold_ab  # noqa: E402
from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from gpu.sampling.sampler import Sampler  # noqa: E402
from gpu.sampling.state import SamplingState  # noqa: E402

PEAK_TB_PER_S = 4.26
PATHS: dict[str, tuple[SamplingParams, int | None]] = {
    "greedy": (SamplingParams(temperature=0.0), None),
    "temperature": (SamplingParams(temperature=0.8), None),
    "top_p_only": (SamplingParams(temperature=0.8, top_p=0.9), None),
    "top_k_top_p": (SamplingParams(temperature=0.8, top_k=50, top_p=0.9), None),
    "top_k_only": (SamplingParams(temperature=0.8, top_k=50), None),
    "min_p_only": (SamplingParams(temperature=0.8, min_p=0.05), None),
    "min_p_penalties": (SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1,
                                       frequency_penalty=0.2), None),
    "temperature_logprobs5": (SamplingParams(temperature=0.8, logprobs=5), 5),
}
SWEEP = [(chunk, block) for chunk in (4096, 8192, 16384) for block in (256, 512, 1024)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sampler.json"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--baseline-root", type=Path, default=_enclosing_checkout(),
                        help="a checkout whose kernels/sampling_thresholds.py is timed beside this one's")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler needs a CUDA GPU")

    logits = torch.randn(args.batch, args.vocab, device="cuda") * 3
    read_ms = logits.numel() * logits.element_size() / (PEAK_TB_PER_S * 1e12) * 1e3
    record = run_record("sampler", {"batch": args.batch, "vocab": args.vocab, "dtype": "float32",
                                    "logits": "randn * 3"})
    record["one_logits_read_ms_at_peak"] = read_ms
    record["thresholds"] = run_threshold_ab(args.batch, args.vocab, None if args.no_baseline else args.baseline_root)
    write_json(args.out, record)
    record["paths"] = {}
    for name in args.paths:
        params, max_num_logprobs = PATHS[name]
        sampler, call = _sampler_call(params, max_num_logprobs, logits)
        record["paths"][name] = {"params": repr(params), "max_num_logprobs": max_num_logprobs,
                                 **_time(call)}
        _print(name, record["paths"][name], read_ms)
        write_json(args.out, record)
    record["paths"]["old_sort_top_p"] = _time(_old_sort_top_p_call(logits))
    _print("old_sort_top_p", record["paths"]["old_sort_top_p"], read_ms)
    if not args.no_sweep:
        record["sweep_top_p"] = _sweep(logits)
    write_json(args.out, record)
    print(f"wrote {args.out}")


def _enclosing_checkout() -> Path | None:
    """The checkout this one was copied into, if any (its kernels are the baseline)."""
    here = Path(__file__).resolve().parents[1]
    for parent in here.parents:
        if (parent / "kernels" / "sampling_thresholds.py").exists():
            return parent
    return None


def _sampler_call(params: SamplingParams, max_num_logprobs: int | None, logits: torch.Tensor
                  ) -> tuple[Sampler, Callable[[], Any]]:
    num_rows, vocab_size = logits.shape
    state = SamplingState(max_num_reqs=num_rows, vocab_size=vocab_size, device="cuda")
    generator = np.random.default_rng(0)
    for row in range(num_rows):
        outputs = generator.integers(0, vocab_size, size=64) if params.uses_penalties else []
        state.add_request(row, params.replace(seed=row), prompt_token_ids=[1, 2, 3],
                          output_token_ids=outputs, eos_token_ids=[0], default_seed=row)
    state.flush_to_device()
    sampler = Sampler(state)
    rows_np = np.arange(num_rows, dtype=np.int32)
    rows_gpu = torch.from_numpy(rows_np).cuda()
    positions = torch.full((num_rows,), 1000, dtype=torch.int64, device="cuda")
    num_output = torch.full((num_rows,), 64, dtype=torch.int32, device="cuda")
    return sampler, lambda: sampler(logits, rows_gpu, rows_np, positions, num_output, max_num_logprobs)


def _old_sort_top_p_call(logits: torch.Tensor) -> Callable[[], Any]:
    """The previous path: temperature and a full-vocabulary sort for top-p, in place."""
    from kernels.gumbel_sample import gumbel_sample
    from kernels.temperature import apply_temperature
    from kernels.top_k_top_p import apply_top_k_top_p

    num_rows, vocab_size = logits.shape
    rows = torch.arange(num_rows, dtype=torch.int32, device="cuda")
    temperature = torch.full((num_rows,), 0.8, device="cuda")
    top_k = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
    top_p = torch.full((num_rows,), 0.9, device="cuda")
    seed = torch.arange(num_rows, dtype=torch.int64, device="cuda")
    positions = torch.full((num_rows,), 1000, dtype=torch.int64, device="cuda")

    def call() -> torch.Tensor:
        processed = logits.clone()
        apply_temperature(processed, rows, temperature)
        apply_top_k_top_p(processed, rows, top_k, top_p, vocab_size)
        return gumbel_sample(processed, rows, temperature, seed, positions, apply_temperature=False)

    return call


def _time(call: Callable[[], Any]) -> dict[str, float]:
    import triton.testing

    eager_ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        call()
    graph_ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return {"median_ms": eager_ms, "graph_median_ms": graph_ms}


def _sweep(logits: torch.Tensor) -> list[dict[str, float]]:
    import kernels.sampling_thresholds as thresholds

    num_rows = logits.shape[0]
    rows = torch.arange(num_rows, dtype=torch.int32, device="cuda")
    temperature = torch.full((num_rows,), 0.8, device="cuda")
    top_k = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
    top_p = torch.full((num_rows,), 0.9, device="cuda")
    min_p = torch.zeros(num_rows, device="cuda")
    default_block = thresholds.BLOCK
    results = []
    for chunk, block in SWEEP:
        thresholds.BLOCK = block
        try:
            timing = _time(lambda: thresholds.sampling_thresholds_triton(
                logits, rows, temperature, top_k, top_p, min_p, chunk=chunk))
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported
            timing = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        results.append({"chunk": chunk, "block": block, **timing})
        print(f"thresholds top-p chunk {chunk} block {block}: {timing}", flush=True)
    thresholds.BLOCK = default_block
    return results


def _print(name: str, timing: dict[str, float], read_ms: float) -> None:
    print(f"{name}: eager {timing['median_ms'] * 1e3:.1f} us, graph {timing['graph_median_ms'] * 1e3:.1f} us "
          f"({timing['graph_median_ms'] / read_ms:.1f}x one read of the logits)", flush=True)


if __name__ == "__main__":
    main()
