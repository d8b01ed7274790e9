"""The device sampler (gpu/sampling/sampler.py), one sampling path at a time.

    python -m benchmarks.sampler [--paths top_p_only top_k_top_p]

Default workload: 256 request rows x vocabulary 151936 (Qwen3), float32 logits drawn as
randn * 3. Paths: greedy, temperature (T=0.8, seeded Gumbel-max), top-p alone (0.9),
top-k + top-p (50, 0.9), top-k alone (50), min-p alone (0.05), min-p + penalties, and
temperature with 5 top logprobs. Each path is the whole Sampler call (host-side op
selection included), timed eagerly and, on CUDA, as replays of a CUDA graph of the call
(the device time, as the runner's sampling graphs run it; the headline figure).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from actors.protocol.sampling_params import SamplingParams
from benchmarks import recording
from benchmarks.kernel_timing import PEAK_BYTES_PER_S, default_device, time_call
from gpu.sampling.sampler import Sampler
from gpu.sampling.state import SamplingState

PATHS: dict[str, tuple[SamplingParams, int | None]] = {
    "greedy": (SamplingParams(temperature=0.0), None),
    "temperature": (SamplingParams(temperature=0.8), None),
    "top_p_only": (SamplingParams(temperature=0.8, top_p=0.9), None),
    "top_k_top_p": (SamplingParams(temperature=0.8, top_k=50, top_p=0.9), None),
    "top_k_only": (SamplingParams(temperature=0.8, top_k=50), None),
    "min_p_only": (SamplingParams(temperature=0.8, min_p=0.05), None),
    "min_p_penalties": (
        SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2),
        None,
    ),
    "temperature_logprobs5": (SamplingParams(temperature=0.8, logprobs=5), 5),
}
"""Path name -> (every row's sampling parameters, max_num_logprobs)."""


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("sampler", __doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--device", default=default_device())
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_name = "sampler" if args.device == "cuda" else "sampler_cpu"
    run = recording.Run(
        "sampler",
        args,
        result_name,
        {
            "batch": args.batch,
            "vocab": args.vocab,
            "dtype": "float32",
            "logits": "randn * 3",
            "device": args.device,
            "paths": args.paths,
        },
        argv,
    )
    generator = torch.Generator(device=args.device).manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=generator, device=args.device) * 3
    read_ms = logits.numel() * logits.element_size() / PEAK_BYTES_PER_S * 1e3
    paths: dict[str, dict[str, Any]] = {}
    for name in args.paths:
        params, max_num_logprobs = PATHS[name]
        timing = time_call(sampler_call(params, max_num_logprobs, logits), args.device)
        paths[name] = {"params": repr(params), "max_num_logprobs": max_num_logprobs, **timing}
        shown = timing.get("graph_median_ms", timing["median_ms"])
        print(
            f"{name}: {shown * 1e3:.1f} us ({shown / read_ms:.1f}x one read of the logits "
            "at the H200's bandwidth)",
            flush=True,
        )
        run.checkpoint({"paths": paths})
    figures = {
        f"{name}_us": round(1e3 * timing.get("graph_median_ms", timing["median_ms"]), 1)
        for name, timing in paths.items()
    }
    run.finish(figures, {"one_logits_read_ms_at_peak": read_ms, "paths": paths})
    return 0


def sampler_call(
    params: SamplingParams, max_num_logprobs: int | None, logits: torch.Tensor
) -> Callable[[], Any]:
    """One Sampler call over every row of `logits`, each row its own seeded request."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    state = SamplingState(max_num_reqs=num_rows, vocab_size=vocab_size, device=str(device))
    rng = np.random.default_rng(0)
    for row in range(num_rows):
        outputs: Any = rng.integers(0, vocab_size, size=64) if params.uses_penalties else []
        state.add_request(
            row,
            params.replace(seed=row),
            prompt_token_ids=[1, 2, 3],
            output_token_ids=outputs,
            eos_token_ids=[0],
            default_seed=row,
        )
    state.flush_to_device()
    sampler = Sampler(state)
    rows_np = np.arange(num_rows, dtype=np.int32)
    rows = torch.from_numpy(rows_np).to(device)
    positions = torch.full((num_rows,), 1000, dtype=torch.int64, device=device)
    num_output = torch.full((num_rows,), 64, dtype=torch.int32, device=device)
    return lambda: sampler(logits, rows, rows_np, positions, num_output, max_num_logprobs)


if __name__ == "__main__":
    sys.exit(main())
