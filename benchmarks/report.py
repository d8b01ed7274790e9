"""Figures derived from a run: vLLM's TTFT/TPOT, GPU idle between steps, and the fraction
of the bandwidth roofline.

Roofline (decode is bound by memory bandwidth): every step reads all weights once, and
every decoding request reads its whole KV history. For a fixed-length workload of N
requests (input I, output O) the KV tokens read over the run are N * (O*I + O*(O-1)/2)
(each output token attends to the prompt and to the outputs before it), so

    ideal_s = (num_steps * weight_bytes + kv_tokens_read * kv_bytes_per_token) / bandwidth
              + prefill_flops / matmul_rate

and the fraction of the roofline is ideal_s / measured wall time. A large model at a large
batch is bound by matmul throughput instead (llama-3.1-8b at batch 1024 does 16 TFLOP per
decode step, 21 ms at 790 TFLOP/s, against 15 ms of memory traffic), so the compute floor
2 * params * N * (I + O) / matmul_rate is reported too, with the fraction of the larger of
the two floors.
"""

from __future__ import annotations

import statistics
from typing import Any

from actors.protocol.messages import StepStats
from benchmarks.tandem_arm import EngineRun
from benchmarks.workloads import Workload
from gpu.models.config import ModelConfig

COPY_BANDWIDTH_BYTES_PER_S = 4.26e12
"""Device-to-device copy bandwidth measured on the H200 (bytes read + written per second)."""
BF16_MATMUL_FLOPS_PER_S = 790e12
"""bf16 dense matmul rate measured on the H200."""
IDLE_MIN_BATCH = 64


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean_ms": 1e3 * statistics.fmean(ordered), "median_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * pick(0.99)}


def latency_figures(run: EngineRun) -> dict[str, Any]:
    """TTFT and TPOT with vLLM's definitions (TPOT = (latency - TTFT) / (outputs - 1))."""
    ttft = [r.ttft_s for r in run.requests]
    tpot = [(r.latency_s - r.ttft_s) / (r.num_output_tokens - 1) for r in run.requests
            if r.num_output_tokens > 1]
    return {"ttft": _percentiles(ttft), "tpot": _percentiles(tpot)}


def gpu_idle_figures(steps: tuple[StepStats, ...], min_batch: int = IDLE_MIN_BATCH) -> dict[str, Any]:
    """Idle fraction = idle / (idle + step time) over steps of at least `min_batch` requests
    (the first step has no predecessor and is left out)."""
    timed = [s for s in steps[1:] if s.step_time_s > 0 and s.num_reqs >= min_batch]
    if not timed:
        return {"measured": False}
    idle = sum(s.gpu_idle_s for s in timed)
    busy = sum(s.step_time_s for s in timed)
    decode = [s for s in timed if s.num_prefill_tokens == 0]
    return {
        "measured": True, "min_batch": min_batch, "num_steps": len(timed),
        "idle_fraction": idle / (idle + busy),
        "decode_idle_fraction": (sum(s.gpu_idle_s for s in decode)
                                 / max(sum(s.gpu_idle_s + s.step_time_s for s in decode), 1e-12)),
        "mean_step_ms": 1e3 * busy / len(timed),
        "mean_decode_step_ms": 1e3 * statistics.fmean(s.step_time_s for s in decode) if decode else None,
        "mean_prepare_ms": 1e3 * statistics.fmean(s.prepare_time_s for s in timed),
    }


def roofline_figures(model: ModelConfig, workload: Workload, num_steps: int, elapsed_s: float,
                     dtype_bytes: int = 2) -> dict[str, Any]:
    n, i, o = workload.num_prompts, workload.input_len, workload.output_len
    # The head matrix is read whole each step; the embedding lookup reads a few rows only.
    embedding_lookup = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    weight_bytes = (model.num_params() - embedding_lookup) * dtype_bytes
    kv_tokens = n * (o * i + o * (o - 1) // 2)
    kv_bytes = kv_tokens * model.kv_bytes_per_token * dtype_bytes
    prefill_flops = 2 * model.num_params() * n * i
    ideal_s = (num_steps * weight_bytes + kv_bytes) / COPY_BANDWIDTH_BYTES_PER_S \
        + prefill_flops / BF16_MATMUL_FLOPS_PER_S
    compute_floor_s = 2 * model.num_params() * n * (i + o) / BF16_MATMUL_FLOPS_PER_S
    return {
        "weight_bytes": weight_bytes, "kv_bytes_read": kv_bytes, "num_steps": num_steps,
        "prefill_flops": prefill_flops, "ideal_s": ideal_s,
        "roofline_output_tok_s": n * o / ideal_s, "fraction_of_roofline": ideal_s / elapsed_s,
        "compute_floor_s": compute_floor_s,
        "fraction_of_larger_floor": max(ideal_s, compute_floor_s) / elapsed_s,
        "bandwidth_bytes_per_s": COPY_BANDWIDTH_BYTES_PER_S,
        "matmul_flops_per_s": BF16_MATMUL_FLOPS_PER_S,
    }


def summarise_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: median and spread of output tokens/s over its repeats."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if "output_tok_s" in run:
            by_arm.setdefault(run["arm"], []).append(run)
    summary = {}
    for arm, arm_runs in by_arm.items():
        rates = [r["output_tok_s"] for r in arm_runs]
        summary[arm] = {"repeats": len(rates), "median_output_tok_s": statistics.median(rates),
                        "min_output_tok_s": min(rates), "max_output_tok_s": max(rates),
                        "num_prompts": arm_runs[0]["num_prompts"]}
    return summary
