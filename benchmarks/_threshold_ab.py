"""Sampling thresholds alone (kernels/sampling_thresholds.py) on the device: checked against
the sort-based reference first, then timed as CUDA-graph replays, interleaved with the same
call of a baseline checkout's kernels when one is given (an A/B in one device call).

The baseline's `kernels` package is imported under its own module objects (sys.modules is
swapped around the import and restored), so both versions live in one process.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

# name: (temperature, top_k, top_p, min_p), every row the same
CASES: dict[str, tuple[float, int, float, float]] = {
    "top_p_only": (0.8, 0, 0.9, 0.0),
    "top_k_top_p": (0.8, 50, 0.9, 0.0),
    "min_p_only": (0.8, 0, 1.0, 0.05),
    "top_k_only": (0.8, 50, 1.0, 0.0),
    "top_p_0.99": (0.8, 0, 0.99, 0.0),
}
MASS_TOLERANCE = 1e-4
"""Largest difference in kept probability (float64) accepted between the search and the
reference: float32 sums in other orders decide tokens at the edge differently."""


def make_logits(kind: str, num_rows: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(0)
    if kind == "randn3":  # bench_sampler's logits
        return torch.randn(num_rows, vocab, device="cuda", generator=generator) * 3
    # shaped more like a language model's: a Gaussian bulk and a few strong candidates
    logits = torch.randn(num_rows, vocab, device="cuda", generator=generator) * 2.5
    logits[:, :50] += 10 * torch.rand(num_rows, 50, device="cuda", generator=generator)
    return logits


def load_baseline(root: Path) -> ModuleType:
    """kernels.sampling_thresholds of the checkout at `root`, beside this checkout's."""
    ours = {name: mod for name, mod in sys.modules.items() if name == "kernels" or name.startswith("kernels.")}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        baseline = importlib.import_module("kernels.sampling_thresholds")
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
            sys.modules[f"baseline_{name}"] = sys.modules.pop(name)
        sys.modules.update(ours)
    return baseline


def _filters(case: tuple[float, int, float, float], num_rows: int) -> tuple[torch.Tensor, ...]:
    temperature, top_k, top_p, min_p = case
    return (torch.arange(num_rows, dtype=torch.int32, device="cuda"),
            torch.full((num_rows,), temperature, device="cuda"),
            torch.full((num_rows,), top_k, dtype=torch.int32, device="cuda"),
            torch.full((num_rows,), top_p, device="cuda"), torch.full((num_rows,), min_p, device="cuda"))


def _kept_mass_gap(logits: torch.Tensor, temperature: float, a: torch.Tensor, b: torch.Tensor) -> float:
    """Per row, the float64 probability of the tokens kept by one threshold and not the
    other (0 where they agree); the largest over the rows."""
    scaled = (logits / temperature if temperature not in (0.0, 1.0) else logits).double()
    probs = torch.softmax(scaled, dim=-1)
    lo, hi = torch.minimum(a, b).double()[:, None], torch.maximum(a, b).double()[:, None]
    return float(torch.where((scaled >= lo) & (scaled < hi), probs, 0.0).sum(-1).max())


def check(module: ModuleType, reference: Callable[..., torch.Tensor], logits: torch.Tensor,
          case: tuple[float, int, float, float]) -> dict[str, Any]:
    """The search against the reference, alone against in the batch, graphed against eager."""
    num_rows = logits.shape[0]
    filters = _filters(case, num_rows)
    actual = module.sampling_thresholds_triton(logits, *filters)
    expected = reference(logits, *filters)
    differ = actual != expected
    gap = _kept_mass_gap(logits[differ], case[0], actual[differ], expected[differ]) if differ.any() else 0.0
    pick = [0, num_rows // 2, num_rows - 1]
    alone = [module.sampling_thresholds_triton(logits[i:i + 1], filters[0][i:i + 1], *filters[1:])
             for i in pick]
    invariant = all(torch.equal(row, actual[i:i + 1]) for row, i in zip(alone, pick))
    graph_out = _graphed(lambda: module.sampling_thresholds_triton(logits, *filters))[1]
    ok = gap <= MASS_TOLERANCE and invariant and torch.equal(graph_out, actual)
    return {"ok": ok, "rows_differing": int(differ.sum()), "max_kept_mass_gap": gap,
            "batch_invariant": invariant, "graph_equals_eager": torch.equal(graph_out, actual)}


def _graphed(call: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def graph_us(module: ModuleType, logits: torch.Tensor, case: tuple[float, int, float, float]) -> float:
    import triton.testing

    filters = _filters(case, logits.shape[0])
    graph, _ = _graphed(lambda: module.sampling_thresholds_triton(logits, *filters))
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3


def run(num_rows: int, vocab: int, baseline_root: Path | None, repeats: int = 3) -> dict[str, Any]:
    """Checks, then interleaved timings (this tree, then the baseline, `repeats` times)."""
    from kernels import sampling_thresholds as ours

    arms = {"branch": ours}
    if baseline_root is not None:
        arms["baseline"] = load_baseline(baseline_root)
    results: dict[str, Any] = {"baseline_root": str(baseline_root) if baseline_root else None, "logits": {}}
    for kind in ("randn3", "peaked"):
        logits = make_logits(kind, num_rows, vocab)
        per_case = results["logits"][kind] = {}
        for name, case in CASES.items():
            entry = per_case[name] = {"filters": dict(zip(("temperature", "top_k", "top_p", "min_p"), case))}
            for arm, module in arms.items():
                entry[f"{arm}_check"] = check(module, ours.sampling_thresholds_ref, logits, case)
            for arm, module in arms.items():
                entry[f"{arm}_graph_us"] = []
            for _ in range(repeats):
                for arm, module in arms.items():
                    entry[f"{arm}_graph_us"].append(graph_us(module, logits, case))
            _print(kind, name, entry, list(arms))
    return results


def _print(kind: str, name: str, entry: dict[str, Any], arms: list[str]) -> None:
    cells = []
    for arm in arms:
        times = entry[f"{arm}_graph_us"]
        check_ok = "ok" if entry[f"{arm}_check"]["ok"] else "CHECK FAILED"
        cells.append(f"{arm} {median(times):7.1f} us ({check_ok})")
    print(f"thresholds {kind:10s} {name:12s} " + "  ".join(cells), flush=True)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else math.nan
