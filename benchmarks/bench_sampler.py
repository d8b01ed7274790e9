"""Time the GPU sampler on a CUDA GPU, one sampling path at a time.

Default workload: batch 256 x vocab 151936 (Qwen3) float32 logits, 256 request rows.
Paths: greedy, temperature (T=0.8, seeded Gumbel-max), top-k/top-p (k=50, p=0.9),
min-p + penalties, and temperature with 5 top logprobs. Each is the whole Sampler call
(host-side op selection included), timed with triton.testing.do_bench (median), next to
the time of one read of the logits at the H200's measured 4.26 TB/s.

    python benchmarks/bench_sampler.py --out benchmarks/results/sampler.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.sampling_params import SamplingParams  # noqa: E402
from gpu.sampling.sampler import Sampler  # noqa: E402
from gpu.sampling.state import SamplingState  # noqa: E402

PEAK_TB_PER_S = 4.26
PATHS: dict[str, tuple[SamplingParams, int | None]] = {
    "greedy": (SamplingParams(temperature=0.0), None),
    "temperature": (SamplingParams(temperature=0.8), None),
    "top_k_top_p": (SamplingParams(temperature=0.8, top_k=50, top_p=0.9), None),
    "top_p_only": (SamplingParams(temperature=0.8, top_p=0.9), None),
    "min_p_penalties": (SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1,
                                       frequency_penalty=0.2), None),
    "temperature_logprobs5": (SamplingParams(temperature=0.8, logprobs=5), 5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sampler.json"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler needs a CUDA GPU")

    logits = torch.randn(args.batch, args.vocab, device="cuda") * 3
    read_ms = logits.numel() * logits.element_size() / (PEAK_TB_PER_S * 1e12) * 1e3
    results = {}
    for name in args.paths:
        params, max_num_logprobs = PATHS[name]
        results[name] = _time_path(params, max_num_logprobs, logits)
        print(f"{name}: {results[name]['median_ms'] * 1e3:.1f} us "
              f"({results[name]['median_ms'] / read_ms:.1f}x one read of the logits)")
    record = {
        "benchmark": "sampler",
        "command": " ".join(sys.argv),
        "commit": os.environ.get("TANDEM_COMMIT") or _git_commit(),
        "hardware": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": {"batch": args.batch, "vocab": args.vocab, "dtype": "float32"},
        "one_logits_read_ms_at_peak": read_ms,
        "paths": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


def _time_path(params: SamplingParams, max_num_logprobs: int | None, logits: torch.Tensor) -> dict[str, Any]:
    import triton.testing

    num_rows, vocab_size = logits.shape
    state = SamplingState(max_num_reqs=num_rows, vocab_size=vocab_size, device="cuda")
    generator = np.random.default_rng(0)
    for row in range(num_rows):
        outputs = generator.integers(0, vocab_size, size=64) if params.uses_penalties else []
        state.add_request(row, params.replace(seed=row), prompt_token_ids=[1, 2, 3],
                          output_token_ids=outputs, eos_token_ids=[0], default_seed=row)
    sampler = Sampler(state)
    rows_np = np.arange(num_rows, dtype=np.int32)
    rows_gpu = torch.from_numpy(rows_np).cuda()
    positions = torch.full((num_rows,), 1000, dtype=torch.int64, device="cuda")
    num_output = torch.full((num_rows,), 64, dtype=torch.int32, device="cuda")

    def run() -> None:
        sampler(logits, rows_gpu, rows_np, positions, num_output, max_num_logprobs)

    median_ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    return {"params": repr(params), "max_num_logprobs": max_num_logprobs, "median_ms": median_ms}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    main()
