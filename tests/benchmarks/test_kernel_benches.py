"""The kernel benchmarks run where the CPU runs the kernels' torch references: a small
`python -m benchmarks.paged_attention`, `python -m benchmarks.sampler` and `python -m
benchmarks.fp8_gemv`, checked against the reference first, and what they record; and what
`benchmarks.fp8_gemv_ncu` hands Nsight Compute."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks import fp8_gemv, fp8_gemv_ncu, paged_attention, sampler
from kernels.fp8_gemv import fp8_gemv_config
from kernels.fp8_quant import FP8_DTYPE


def test_paged_attention_checks_the_kernel_then_times_it(tmp_path: Path) -> None:
    out = tmp_path / "pa.json"
    assert (
        paged_attention.main(
            [
                "--batch",
                "3",
                "--context",
                "40",
                "--num-heads",
                "4",
                "--num-kv-heads",
                "2",
                "--head-dim",
                "16",
                "--device",
                "cpu",
                "--not-a-result",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    assert record["workload"]["dtype"] == "float32" and record["workload"]["batch"] == 3
    details = record["details"]
    assert details["kv_bytes_read"] == 2 * 3 * 40 * 2 * 16 * 4
    assert details["max_abs_err_vs_ref"] == 0.0  # on the CPU the reference itself runs
    assert record["figures"]["median_us"] > 0 and details["sweep"] == []


def test_sampler_times_each_path(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    assert (
        sampler.main(
            [
                "--batch",
                "4",
                "--vocab",
                "300",
                "--device",
                "cpu",
                "--paths",
                "greedy",
                "top_p_only",
                "temperature_logprobs5",
                "--not-a-result",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    assert set(record["figures"]) == {"greedy_us", "top_p_only_us", "temperature_logprobs5_us"}
    paths = record["details"]["paths"]
    assert paths["temperature_logprobs5"]["max_num_logprobs"] == 5
    assert all(p["median_ms"] > 0 and "graph_median_ms" not in p for p in paths.values())


def test_fp8_gemv_checks_each_projection_then_times_it(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    assert fp8_gemv.main(["--device", "cpu", "--not-a-result", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    projections = record["details"]["projections"]
    assert set(projections) == {"qkv", "down"} and set(record["figures"]) == {"qkv_us", "down_us"}
    for row in projections.values():
        assert row["max_rel_err_vs_ref"] <= 1e-5  # on the CPU the reference itself runs
        assert row["us"] > 0 and "sweep" not in row


def test_fp8_gemv_sweep_covers_splits_around_the_default() -> None:
    default = fp8_gemv_config(1, 4096, 14336)
    configs = fp8_gemv._sweep_configs(default)
    assert default in configs and len(configs) == len(set(configs))
    assert {c.split_k for c in configs} == {
        default.split_k // 2,
        default.split_k,
        default.split_k * 2,
    }


def test_fp8_gemv_ncu_needs_a_gpu_and_names_each_kernel_it_profiles(capsys) -> None:
    if not torch.cuda.is_available():
        assert fp8_gemv_ncu.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    w_fp8, w_scale = torch.zeros(64, 128, dtype=FP8_DTYPE), torch.ones(64)
    kernels = fp8_gemv_ncu._kernels(torch.zeros(1, 128).bfloat16(), w_fp8, w_scale)
    assert {"w8a16", "bf16"} <= set(kernels) <= {"w8a16", "bf16", "w8a8"}
    assert torch.equal(kernels["bf16"](), torch.zeros(1, 64).bfloat16())
