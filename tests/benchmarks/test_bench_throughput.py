"""`tandem bench throughput` helpers: ABBA order, workloads, vLLM's TPOT, GPU idle fraction
and the bandwidth roofline, plus the CLI's argument errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from actors.protocol.messages import StepStats
from benchmarks.report import gpu_idle_figures, latency_figures, roofline_figures
from benchmarks.tandem_arm import EngineRun, RequestTiming
from benchmarks.throughput import abba_order
from benchmarks.workloads import WORKLOADS, random_prompts, workload_by_name
from gpu.models.config import PRESETS


def test_abba_order_alternates_which_arm_goes_first() -> None:
    assert abba_order(("v2", "v1"), 2) == ["v2", "v1", "v1", "v2"]
    assert abba_order(("v2", "v1"), 3) == ["v2", "v1", "v1", "v2", "v2", "v1"]
    assert abba_order(("v2",), 2) == ["v2", "v2"]


def test_workloads_match_the_issue_and_prompts_are_fixed_length() -> None:
    w1, w2, w3 = WORKLOADS["W1"], WORKLOADS["W2"], WORKLOADS["W3"]
    assert (w1.model, w1.num_prompts, w1.input_len, w1.output_len) == ("dummy:qwen3-0.6b", 1024, 128, 512)
    assert (w2.model, w2.num_prompts, w2.input_len, w2.output_len) == ("dummy:qwen3-0.6b", 1000, 1024, 128)
    assert (w3.model, w3.num_prompts, w3.input_len, w3.output_len) == ("dummy:llama-3.1-8b", 1024, 128, 512)
    assert workload_by_name("w2") is w2
    with pytest.raises(ValueError, match="unknown workload 'W9'"):
        workload_by_name("W9")
    prompts = random_prompts(5, 7, vocab_size=11, seed=1)
    assert [len(p) for p in prompts] == [7] * 5
    assert all(0 <= t < 11 for p in prompts for t in p)
    assert prompts == random_prompts(5, 7, vocab_size=11, seed=1)
    assert len({tuple(p) for p in prompts}) == 5


def test_tpot_follows_vllm_definition() -> None:
    # 11 tokens, first after 0.5 s, last at 2.5 s: TPOT = (2.5 - 0.5) / 10.
    run = EngineRun(3.0, (RequestTiming(11, 0.5, 2.5, "length"), RequestTiming(1, 0.2, 0.2, "length")),
                    (), 0)
    figures = latency_figures(run)
    assert figures["tpot"]["mean_ms"] == pytest.approx(200.0)  # the 1-token request has no TPOT
    assert figures["ttft"]["median_ms"] == pytest.approx(350.0)


def test_gpu_idle_fraction_skips_the_first_step_and_small_batches() -> None:
    def step(num_reqs: int, busy_s: float, idle_s: float) -> StepStats:
        return StepStats(0, num_reqs, num_reqs, 0, step_time_s=busy_s, gpu_idle_s=idle_s)

    steps = (step(128, 0.010, 5.0), step(128, 0.010, 0.001), step(8, 0.010, 0.5),
             step(128, 0.010, 0.003))
    figures = gpu_idle_figures(steps, min_batch=64)
    assert figures["num_steps"] == 2
    assert figures["idle_fraction"] == pytest.approx(0.004 / 0.024)
    assert gpu_idle_figures((), 64) == {"measured": False}


def test_roofline_of_w1_is_near_the_design_figure() -> None:
    # DESIGN.md: qwen3-0.6b in bf16 reads 1.19 GB of weights per step and 114,688 KV bytes per
    # token; W1 on 4.26 TB/s caps output near 90k tokens/s.
    model, workload = PRESETS["qwen3-0.6b"], WORKLOADS["W1"]
    figures = roofline_figures(model, workload, num_steps=512, elapsed_s=10.0)
    assert figures["weight_bytes"] == pytest.approx(1.19e9, rel=0.01)
    assert model.kv_bytes_per_token * 2 == 114688
    kv_tokens_per_request = 512 * 128 + 512 * 511 // 2
    assert figures["kv_bytes_read"] == 1024 * kv_tokens_per_request * 114688
    assert 85_000 < figures["roofline_output_tok_s"] < 95_000
    assert figures["fraction_of_roofline"] == pytest.approx(figures["ideal_s"] / 10.0)


def test_cli_rejects_unknown_arms_and_workloads() -> None:
    def tandem(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.cli", "bench", "throughput", *args],
                              capture_output=True, text=True, timeout=120)

    bad_arm = tandem("--arms", "v2,vllm")
    assert bad_arm.returncode == 2 and "--arms must include v2" in bad_arm.stderr
    bad_workload = tandem("--workload", "W7")
    assert bad_workload.returncode == 2 and "unknown workload 'W7'" in bad_workload.stderr
