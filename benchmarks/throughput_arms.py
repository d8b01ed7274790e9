"""The arms of benchmarks.throughput and the order they run in: tandem's V2 and V1 runners on
one loaded model (ABBA over the repeats, after an untimed warmup), then the transformers arms
on the same weights (benchmarks.hf_arms), each run's record, and the startup figures of the
first engine (load, graph capture, Triton cache, time since the process started)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.throughput_engine import (
    EngineRun,
    fixed_length_params,
    free_device_memory,
    run_engine,
)
from benchmarks.throughput_figures import gpu_idle_figures, latency_figures, summarise_runs
from benchmarks.workloads import Workload, floors, random_prompts

TANDEM_ARMS = ("v2", "v1")
HF_ARMS = ("hf_static", "hf_continuous")


def run_arms(
    workload: Workload, engine_options: dict[str, Any], args: Any, checkpoint: Any
) -> dict[str, Any]:
    details: dict[str, Any] = {
        "sampling": "temperature 1.0, top_p 1.0, ignore_eos, min_tokens = max_tokens = output_len",
        "arms": args.arms,
        "repeats": args.repeats,
        "hf_num_prompts": args.hf_num_prompts,
        "hf_batch_size": args.hf_batch_size,
        "order": "tandem arms ABBA (v2 v1 v1 v2 ...), then each transformers arm once",
        "runs": [],
    }
    model, prompts = _run_tandem_arms(details, workload, engine_options, args, checkpoint)
    hf_arms = [a for a in HF_ARMS if a in args.arms]
    if hf_arms:
        # The engines are gone by now; their KV cache and CUDA graphs are freed so that
        # transformers' own copies (gpt-oss's bf16 experts: 38 GB) fit beside the weights.
        free_device_memory()
        _run_hf_arms(
            details, hf_arms, model, prompts[: args.hf_num_prompts], workload, args.hf_batch_size
        )
    details["summary"] = summarise_runs(details["runs"])
    return details


def _run_tandem_arms(
    details: dict[str, Any],
    workload: Workload,
    engine_options: dict[str, Any],
    args: Any,
    checkpoint: Any,
) -> tuple[Any, list[list[int]]]:
    """tandem's arms (and the kernel profile): their records go into `details`. Returns the
    loaded model and the prompts; the engines are closed and unreferenced on return."""
    from app.llm import LLM

    triton_cache_was_empty = _triton_cache_is_empty()
    started = time.perf_counter()
    v2 = LLM(workload.model, runner="v2", **engine_options)
    details["startup"] = _startup_figures(v2, time.perf_counter() - started, triton_cache_was_empty)
    if getattr(args, "default_arms", False) and v2.worker.model.precision.schemes:
        args.arms = [arm for arm in args.arms if arm not in HF_ARMS]  # nothing to share
        details["arms"] = args.arms
    llms = {"v2": v2}
    if "v1" in args.arms:
        llms["v1"] = LLM(workload.model, reuse=v2, runner="v1", **engine_options)
    prompts = random_prompts(
        workload.num_prompts, workload.input_len, v2.worker.model_config.vocab_size, seed=0
    )
    tandem_arms = tuple(a for a in TANDEM_ARMS if a in args.arms)
    details["warmup"] = _warm_up(llms, tandem_arms, prompts, engine_options["max_num_seqs"])
    for arm in abba_order(tandem_arms, args.repeats):
        engine_run = run_engine(llms[arm], prompts, fixed_length_params(workload.output_len))
        details["runs"].append(_tandem_run_record(arm, engine_run, v2, workload))
        details["summary"] = summarise_runs(details["runs"])
        checkpoint(details)
        print(_describe(details["runs"][-1]), flush=True)
    if getattr(args, "kernel_profile", False):
        if engine_options["device"] == "cuda":
            details["kernel_profile"] = _profile_v2(v2, prompts, workload.output_len)
            checkpoint(details)
        else:
            print("--kernel-profile: CUDA kernels only; nothing to profile on the CPU")
    for llm in llms.values():
        llm.close()
    return v2.worker.model, prompts


def _profile_v2(v2: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """One untimed v2 run under torch.profiler: device time per step by kernel."""
    from benchmarks.kernel_profile import format_kernels, profile_kernels

    def run() -> int:
        return len(run_engine(v2, prompts, fixed_length_params(output_len)).steps)

    summary = profile_kernels(run)
    print(format_kernels(summary), flush=True)
    return summary


def abba_order(arms: tuple[str, ...], repeats: int) -> list[str]:
    """v2 v1 v1 v2 v2 v1 ...: each arm sees early and late positions equally often."""
    order: list[str] = []
    for repeat in range(repeats):
        order.extend(arms if repeat % 2 == 0 else tuple(reversed(arms)))
    return order


def _startup_figures(llm: Any, ready_s: float, triton_cache_was_empty: bool) -> dict[str, Any]:
    worker = llm.worker
    graphs = getattr(worker, "graphs", None)
    memory_report = getattr(worker, "memory_report", None)
    kv_spec = getattr(worker, "kv_spec", None)
    return {
        "ready_s": ready_s,
        "process_age_at_ready_s": _process_age_s(),
        "runner": llm.runner,
        "weights": getattr(worker, "weights_precision", None),
        "weights_load_s": getattr(worker, "load_time_s", None),
        "graph_capture_s": graphs.capture_time_s if graphs is not None else None,
        "num_graphs": graphs.num_captured if graphs is not None else 0,
        "graph_memory_bytes": getattr(worker, "graph_memory_bytes", None),
        "kv_cache_tokens": kv_spec.num_tokens if kv_spec is not None else None,
        "memory_report": asdict(memory_report) if memory_report is not None else None,
        "triton_cache": "cold" if triton_cache_was_empty else "warm",
    }


def _warm_up(
    llms: dict[str, Any], arms: tuple[str, ...], prompts: list[list[int]], max_num_seqs: int
) -> dict[str, Any]:
    """One short run per arm at full concurrency: compiles the prefill kernels' shapes."""
    num_prompts = min(len(prompts), max_num_seqs)
    seconds = {}
    for arm in arms:
        started = time.perf_counter()
        run_engine(llms[arm], prompts[:num_prompts], fixed_length_params(8))
        seconds[arm] = time.perf_counter() - started
    return {
        "description": f"{num_prompts} prompts x 8 output tokens per tandem arm, untimed; "
        "one 8-prompt x 4-token generate for the transformers arms",
        "seconds": seconds,
    }


def _tandem_run_record(arm: str, run: EngineRun, v2: Any, workload: Workload) -> dict[str, Any]:
    num_tokens = run.num_output_tokens
    bound = floors(v2.worker.model_config, workload, num_steps=len(run.steps))
    return {
        "arm": arm,
        "num_prompts": len(run.requests),
        "elapsed_s": run.elapsed_s,
        "output_tokens": num_tokens,
        "all_outputs_full_length": num_tokens == workload.num_prompts * workload.output_len,
        "output_tok_s": num_tokens / run.elapsed_s,
        "total_tok_s": (num_tokens + len(run.requests) * workload.input_len) / run.elapsed_s,
        "num_steps": len(run.steps),
        "num_preemptions": run.num_preemptions,
        **latency_figures(run),
        "gpu_idle": gpu_idle_figures(run.steps),
        "floor": {
            **bound,
            "fraction_of_roofline": bound["ideal_s"] / run.elapsed_s,
            "fraction_of_larger_floor": max(bound["ideal_s"], bound["compute_floor_s"])
            / run.elapsed_s,
        },
    }


def _run_hf_arms(
    details: dict[str, Any],
    arms: list[str],
    model: Any,
    prompts: list[list[int]],
    workload: Workload,
    batch_size: int,
) -> None:
    import torch

    from benchmarks.hf_arms import (
        hf_model_sharing_weights,
        run_hf_continuous,
        run_hf_static_fitting,
        warm_up_hf,
    )

    try:  # a transformers model that cannot be built (no room for its copies) is reported
        hf = hf_model_sharing_weights(model)
        warm_up_hf(hf, prompts)
    except Exception as exc:  # noqa: BLE001
        for arm in arms:
            details["runs"].append({"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(_describe(details["runs"][-1]), flush=True)
        return
    details["hf_implementation"] = {
        "attention": getattr(hf.config, "_attn_implementation", None),
        "experts": getattr(hf.config, "_experts_implementation", None),
    }
    for arm in arms:
        try:
            too_large: list[int] = []
            if arm == "hf_static":
                run, too_large = run_hf_static_fitting(hf, prompts, workload.output_len, batch_size)
            else:
                run = run_hf_continuous(hf, prompts, workload.output_len)
            details["runs"].append(
                {
                    "arm": arm,
                    "num_prompts": run.num_prompts,
                    "batch_size": run.batch_size,
                    "batch_sizes_out_of_memory": too_large,
                    "elapsed_s": run.elapsed_s,
                    "output_tokens": run.num_output_tokens,
                    "all_outputs_full_length": run.num_output_tokens
                    == run.num_prompts * workload.output_len,
                    "output_tok_s": run.num_output_tokens / run.elapsed_s,
                    "note": f"subset: the first {run.num_prompts} of the workload's prompts",
                }
            )
        except Exception as exc:  # noqa: BLE001 - a failing baseline is reported, not fatal
            details["runs"].append({"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:500]})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(_describe(details["runs"][-1]), flush=True)


def _describe(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"{run['arm']}: ERROR {run['error']}"
    extra = ""
    if run.get("gpu_idle", {}).get("measured"):
        extra = (
            f", gpu idle {100 * run['gpu_idle']['idle_fraction']:.1f}%, "
            f"{100 * run['floor']['fraction_of_roofline']:.1f}% of the floor"
        )
    return (
        f"{run['arm']}: {run['output_tok_s']:,.0f} output tok/s ({run['output_tokens']} "
        f"tokens in {run['elapsed_s']:.2f} s{extra})"
    )


def _triton_cache_is_empty() -> bool:
    cache_dir = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return not cache_dir.is_dir() or not any(cache_dir.iterdir())


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux), so 'ready' includes imports."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return uptime_s - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
