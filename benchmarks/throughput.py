"""`tandem bench throughput`: one workload, tandem V2 and V1 interleaved ABBA, then the
transformers arms on the same weights; the JSON result is rewritten after every run, so an
interrupted benchmark still leaves what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.hf_arms import HFRun, run_hf_continuous, run_hf_static, warm_up_hf
from benchmarks.report import gpu_idle_figures, latency_figures, roofline_figures, summarise_runs
from benchmarks.tandem_arm import EngineRun, fixed_length_params, run_engine
from benchmarks.workloads import HF_ARMS, TANDEM_ARMS, Workload, random_prompts
from app.llm import LLM


def abba_order(arms: tuple[str, ...], repeats: int) -> list[str]:
    """v2 v1 v1 v2 v2 v1 ...: each arm sees early and late positions equally often."""
    order: list[str] = []
    for repeat in range(repeats):
        order.extend(arms if repeat % 2 == 0 else tuple(reversed(arms)))
    return order


def run_benchmark(workload: Workload, engine_options: dict[str, Any], arms: list[str],
                  repeats: int, hf_num_prompts: int, hf_batch_size: int, out_path: Path,
                  command: str) -> dict[str, Any]:
    record = _header(workload, engine_options, arms, repeats, command)
    triton_cache_was_empty = _triton_cache_is_empty()
    started = time.perf_counter()
    v2 = LLM(workload.model, runner="v2", **engine_options)
    record["startup"] = _startup_figures(v2, time.perf_counter() - started, triton_cache_was_empty)
    _write(out_path, record)
    llms = {"v2": v2}
    if "v1" in arms:
        llms["v1"] = LLM(workload.model, reuse=v2, runner="v1", **engine_options)
    prompts = random_prompts(workload.num_prompts, workload.input_len,
                             v2.worker.model_config.vocab_size, seed=0)
    tandem_arms = tuple(a for a in TANDEM_ARMS if a in arms)
    record["warmup"] = _warm_up_tandem(llms, tandem_arms, prompts, engine_options)
    for arm in abba_order(tandem_arms, repeats):
        run = run_engine(llms[arm], prompts, fixed_length_params(workload.output_len))
        record["runs"].append(_tandem_run_record(arm, run, v2, workload))
        record["summary"] = summarise_runs(record["runs"])
        _write(out_path, record)
        print(_describe(record["runs"][-1]), flush=True)
    hf_arms = [a for a in HF_ARMS if a in arms]
    if hf_arms:
        _run_hf_arms(record, hf_arms, v2, prompts[:hf_num_prompts], workload, hf_batch_size,
                     out_path)
    record["summary"] = summarise_runs(record["runs"])
    record["targets"] = _targets(record)
    _write(out_path, record)
    return record


def _header(workload: Workload, engine_options: dict[str, Any], arms: list[str], repeats: int,
            command: str) -> dict[str, Any]:
    return {
        "benchmark": "throughput", "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": os.environ.get("TANDEM_COMMIT") or _git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "command": command, "workload": workload.as_dict(),
        "sampling": "temperature 1.0, top_p 1.0, ignore_eos, min_tokens = max_tokens = output_len",
        "engine_options": engine_options, "arms": arms, "repeats": repeats,
        "order": "tandem arms ABBA (v2 v1 v1 v2 ...), then each transformers arm once",
        "runs": [],
    }


def _startup_figures(llm: LLM, ready_s: float, triton_cache_was_empty: bool) -> dict[str, Any]:
    worker = llm.worker
    graphs = worker.graphs
    return {
        "ready_s": ready_s, "process_age_at_ready_s": _process_age_s(),
        "weights_load_s": worker.load_time_s,
        "graph_capture_s": graphs.capture_time_s if graphs is not None else None,
        "num_graphs": graphs.num_captured if graphs is not None else 0,
        "graph_memory_bytes": worker.graph_memory_bytes,
        "kv_cache_tokens": worker.kv_spec.num_tokens,
        "memory_report": asdict(worker.memory_report) if worker.memory_report else None,
        "triton_cache": "cold" if triton_cache_was_empty else "warm",
    }


def _warm_up_tandem(llms: dict[str, LLM], arms: tuple[str, ...], prompts: list[list[int]],
                    engine_options: dict[str, Any]) -> dict[str, Any]:
    """One short run per arm at full concurrency: compiles the prefill kernels' shapes."""
    num_prompts = min(len(prompts), engine_options.get("max_num_seqs", 256))
    seconds = {}
    for arm in arms:
        started = time.perf_counter()
        run_engine(llms[arm], prompts[:num_prompts], fixed_length_params(8))
        seconds[arm] = time.perf_counter() - started
    return {"description": f"{num_prompts} prompts x 8 output tokens per tandem arm, untimed; "
                           "one 8-prompt x 4-token generate for the transformers arms",
            "seconds": seconds}


def _tandem_run_record(arm: str, run: EngineRun, v2: LLM, workload: Workload) -> dict[str, Any]:
    num_tokens = run.num_output_tokens
    expected = workload.num_prompts * workload.output_len
    return {
        "arm": arm, "num_prompts": len(run.requests), "elapsed_s": run.elapsed_s,
        "output_tokens": num_tokens, "all_outputs_full_length": num_tokens == expected,
        "output_tok_s": num_tokens / run.elapsed_s,
        "total_tok_s": (num_tokens + len(run.requests) * workload.input_len) / run.elapsed_s,
        "num_steps": len(run.step_stats), "num_preemptions": run.num_preemptions,
        **latency_figures(run),
        "gpu_idle": gpu_idle_figures(run.step_stats),
        "roofline": roofline_figures(v2.worker.model_config, workload, len(run.step_stats),
                                     run.elapsed_s),
    }


def _run_hf_arms(record: dict[str, Any], arms: list[str], v2: LLM, prompts: list[list[int]],
                 workload: Workload, batch_size: int, out_path: Path) -> None:
    from benchmarks.hf_model import hf_model_sharing_weights

    hf = hf_model_sharing_weights(v2.worker.model)
    warm_up_hf(hf, prompts)
    for arm in arms:
        try:
            if arm == "hf_static":
                run = run_hf_static(hf, prompts, workload.output_len, batch_size)
            else:
                run = run_hf_continuous(hf, prompts, workload.output_len)
            record["runs"].append(_hf_run_record(arm, run, workload))
        except Exception as exc:  # noqa: BLE001 - a failing baseline is reported, not fatal
            record["runs"].append({"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:500]})
        torch.cuda.empty_cache()
        record["summary"] = summarise_runs(record["runs"])
        _write(out_path, record)
        print(_describe(record["runs"][-1]), flush=True)


def _hf_run_record(arm: str, run: HFRun, workload: Workload) -> dict[str, Any]:
    expected = run.num_prompts * workload.output_len
    return {"arm": arm, "num_prompts": run.num_prompts, "batch_size": run.batch_size,
            "elapsed_s": run.elapsed_s, "output_tokens": run.num_output_tokens,
            "all_outputs_full_length": run.num_output_tokens == expected,
            "output_tok_s": run.num_output_tokens / run.elapsed_s,
            "note": f"subset: the first {run.num_prompts} of the workload's prompts"}


def _targets(record: dict[str, Any]) -> dict[str, Any]:
    summary = record["summary"]
    rate = {arm: s["median_output_tok_s"] for arm, s in summary.items()}
    targets: dict[str, Any] = {"ready_s": record["startup"]["ready_s"]}
    if "v2" in rate:
        targets["v2_output_tok_s"] = rate["v2"]
        idle = [r["gpu_idle"].get("idle_fraction") for r in record["runs"]
                if r.get("arm") == "v2" and r.get("gpu_idle", {}).get("measured")]
        targets["v2_gpu_idle_fraction_batch_ge_64"] = max(idle) if idle else None
    if "v2" in rate and "v1" in rate:
        targets["v2_over_v1"] = rate["v2"] / rate["v1"]
    hf_rates = [rate[a] for a in HF_ARMS if a in rate]
    if "v2" in rate and hf_rates:
        targets["v2_over_best_transformers"] = rate["v2"] / max(hf_rates)
    return targets


def _describe(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"{run['arm']}: ERROR {run['error']}"
    extra = ""
    if "gpu_idle" in run and run["gpu_idle"].get("measured"):
        extra = (f", gpu idle {100 * run['gpu_idle']['idle_fraction']:.1f}%, "
                 f"roofline {100 * run['roofline']['fraction_of_roofline']:.1f}%")
    return (f"{run['arm']}: {run['output_tok_s']:,.0f} output tok/s ({run['output_tokens']} tokens "
            f"in {run['elapsed_s']:.2f} s{extra})")


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


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
