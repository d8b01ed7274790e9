"""One TP size of benchmarks/bench_tp_engine.py, in its own process: load the engine,
run the check or the timed batches, close the engine (its worker ranks exit)."""

from __future__ import annotations

import time
from typing import Any

import torch

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from benchmarks.report import gpu_idle_figures, latency_figures
from benchmarks.tandem_arm import fixed_length_params, run_engine
from benchmarks.workloads import random_prompts

WARMUP_PROMPTS, WARMUP_TOKENS = 4, 8


def run_check(options: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """Greedy and seeded (T = 0.8, top-p 0.9) tokens of the check prompts."""
    with LLM(**options) as llm:
        prompts = random_prompts(job["num_prompts"], 24, llm.worker.model_config.vocab_size,
                                 seed=7)
        greedy = SamplingParams(temperature=0.0, max_tokens=job["num_tokens"], ignore_eos=True)
        sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True,
                                  max_tokens=job["num_tokens"]) for i in range(len(prompts))]
        return {"greedy": [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)],
                "sampled": [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampled)],
                "runner": llm.runner}


def run_timing(options: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    with LLM(**options) as llm:
        ready_s = time.perf_counter() - started
        worker = llm.worker
        vocab_size = worker.model_config.vocab_size
        result: dict[str, Any] = {
            "tp": options["tensor_parallel_size"], "model": options["model"], "runner": llm.runner,
            "ready_s": ready_s, "kv_blocks": worker.kv_spec.num_blocks,
            "kv_cache_gib": worker.kv_spec.num_bytes / 2**30,
            "cuda_graphs": worker.graphs is not None, "batches": {}}
        if worker.device.type == "cuda":
            result["weights_gib_rank0"] = sum(
                p.numel() * p.element_size() for p in worker.model.parameters()) / 2**30
            result["graph_memory_gib_rank0"] = worker.graph_memory_bytes / 2**30
        run_engine(llm, random_prompts(WARMUP_PROMPTS, job["input_len"], vocab_size, seed=1),
                   fixed_length_params(WARMUP_TOKENS))
        for batch in job["batch"]:
            prompts = random_prompts(batch, job["input_len"], vocab_size, seed=batch)
            run = run_engine(llm, prompts, fixed_length_params(job["output_len"]))
            latency = latency_figures(run)
            idle = gpu_idle_figures(run.step_stats, min_batch=1)
            result["batches"][str(batch)] = {
                "elapsed_s": run.elapsed_s, "num_output_tokens": run.num_output_tokens,
                "output_tok_s": run.num_output_tokens / run.elapsed_s,
                "tpot": _seconds(latency["tpot"]), "ttft": _seconds(latency["ttft"]),
                "mean_decode_step_ms": idle.get("mean_decode_step_ms"),
                "gpu_idle_fraction": idle.get("idle_fraction"),
                "num_preemptions": run.num_preemptions,
                "finish_reasons": sorted({r.finish_reason or "none" for r in run.requests})}
        if worker.device.type == "cuda":
            result["peak_allocated_gib_rank0"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def _seconds(figures: dict[str, float]) -> dict[str, float]:
    """{p50, p99, mean} in seconds from report's milliseconds."""
    if not figures:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    return {"p50": figures["median_ms"] / 1e3, "p99": figures["p99_ms"] / 1e3,
            "mean": figures["mean_ms"] / 1e3}
