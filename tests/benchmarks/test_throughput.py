"""`python -m benchmarks.throughput`: a real run on the embedded model (every arm, steps
observed through the engine client, the record's fields), and its figures on hand-built
runs: ABBA order, the workloads and their floors, vLLM's TPOT, the GPU idle fraction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.protocol.messages import StepStats
from benchmarks.throughput import main, parse_args
from benchmarks.throughput_arms import HF_ARMS, TANDEM_ARMS, abba_order
from benchmarks.throughput_engine import EngineRun, RequestTiming
from benchmarks.throughput_figures import gpu_idle_figures, latency_figures
from benchmarks.workloads import (
    WORKLOADS,
    Workload,
    floors,
    random_prompts,
    step_weight_bytes,
    workload_by_name,
)
from gpu.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_run_on_the_embedded_model_records_every_arm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv_caches = _kv_caches_seen_by_transformers(monkeypatch)
    out = tmp_path / "w.json"
    argv = [
        "--workload",
        "CPU",
        "--num-prompts",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "5",
        "--repeats",
        "1",
        "--arms",
        "v2,v1,hf_static",
        "--hf-num-prompts",
        "2",
        "--quantization",
        "none",  # transformers shares float32 weights only
        "--not-a-result",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["command"] == "python -m benchmarks.throughput " + " ".join(argv)
    assert record["workload"]["name"] == "CPU" and record["workload"]["num_prompts"] == 3
    assert record["workload"]["engine_options"]["device"] == "cpu"
    assert {"date", "commit", "clean", "hardware", "figures", "details"} <= set(record)
    details = record["details"]
    assert [r["arm"] for r in details["runs"]] == ["v2", "v1", "hf_static"]
    for run in details["runs"][:2]:
        assert run["all_outputs_full_length"] and run["output_tokens"] == 3 * 5
        assert run["num_steps"] >= 5  # every step reached the step observer
        assert run["num_preemptions"] == 0
        assert run["tpot"]["median_ms"] > 0 and run["ttft"]["median_ms"] > 0
        assert run["floor"]["fraction_of_roofline"] > 0
    assert details["runs"][2]["output_tokens"] == 2 * 5
    assert kv_caches == ["freed"]  # the engines' KV cache was gone before transformers built
    figures = record["figures"]
    assert figures["v2_output_tok_s"] == pytest.approx(
        details["summary"]["v2"]["median_output_tok_s"], abs=0.05
    )
    assert {"v1_output_tok_s", "hf_static_output_tok_s", "v2_over_v1", "ready_s"} <= set(figures)
    assert details["startup"]["runner"] == "v2"


def _kv_caches_seen_by_transformers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Whether the engines' KV caches still live when the transformers model is built
    ("freed" or "alive", once per build): gpt-oss's own bf16 experts need their room."""
    import weakref

    import app.llm
    import benchmarks.hf_arms

    refs: list[weakref.ref] = []
    seen: list[str] = []

    class TrackedLLM(app.llm.LLM):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            refs.extend(weakref.ref(kv) for kv in self.worker.kv_caches)

    build = benchmarks.hf_arms.hf_model_sharing_weights

    def spy(model: object, *args: object) -> object:
        seen.append("freed" if refs and all(ref() is None for ref in refs) else "alive")
        return build(model, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(app.llm, "LLM", TrackedLLM)
    monkeypatch.setattr(benchmarks.hf_arms, "hf_model_sharing_weights", spy)
    return seen


def test_bad_arms_and_workloads_are_usage_errors() -> None:
    def throughput(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "benchmarks.throughput", *args],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    bad_arm = throughput("--arms", "v2,vllm", "--not-a-result")
    assert bad_arm.returncode == 2 and "--arms must start with v2" in bad_arm.stderr
    bad_workload = throughput("--workload", "W7", "--not-a-result")
    assert bad_workload.returncode == 2 and "invalid choice: 'W7'" in bad_workload.stderr


def test_tensor_and_pipeline_parallel_runs_compare_the_two_runners_only() -> None:
    args = parse_args(["-tp", "2", "-pp", "2", "--not-a-result"])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
    assert args.arms == list(TANDEM_ARMS)
    with pytest.raises(SystemExit):
        parse_args(["-pp", "2", "--arms", "v2,v1,hf_static", "--not-a-result"])
    assert parse_args(["--not-a-result"]).arms == [*TANDEM_ARMS, *HF_ARMS]


def test_abba_order_alternates_which_arm_goes_first() -> None:
    assert abba_order(("v2", "v1"), 2) == ["v2", "v1", "v1", "v2"]
    assert abba_order(("v2", "v1"), 3) == ["v2", "v1", "v1", "v2", "v2", "v1"]
    assert abba_order(("v2",), 2) == ["v2", "v2"]


def test_workloads_match_the_issue_and_prompts_are_fixed_length() -> None:
    w1, w2, w3 = WORKLOADS["W1"], WORKLOADS["W2"], WORKLOADS["W3"]

    def shape(w: Workload) -> tuple[str, int, int, int]:
        return w.model, w.num_prompts, w.input_len, w.output_len

    assert shape(w1) == ("dummy:qwen3-0.6b", 1024, 128, 512)
    assert shape(w2) == ("dummy:qwen3-0.6b", 1000, 1024, 128)
    assert shape(w3) == ("dummy:llama-3.1-8b", 1024, 128, 512)
    assert (WORKLOADS["CPU"].model, WORKLOADS["CPU"].device) == ("default", "cpu")
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
    run = EngineRun(
        3.0, (RequestTiming(11, 0.5, 2.5, "length"), RequestTiming(1, 0.2, 0.2, "length")), (), 0
    )
    figures = latency_figures(run)
    assert figures["tpot"]["mean_ms"] == pytest.approx(200.0)  # the 1-token request has no TPOT
    assert figures["ttft"]["median_ms"] == pytest.approx(350.0)


def test_gpu_idle_fraction_skips_the_first_step_and_small_batches() -> None:
    def step(num_reqs: int, busy_s: float, idle_s: float) -> StepStats:
        return StepStats(0, num_reqs, num_reqs, 0, step_time_s=busy_s, gpu_idle_s=idle_s)

    steps = (
        step(128, 0.010, 5.0),
        step(128, 0.010, 0.001),
        step(8, 0.010, 0.5),
        step(128, 0.010, 0.003),
    )
    figures = gpu_idle_figures(steps, min_batch=64)
    assert figures["num_steps"] == 2
    assert figures["idle_fraction"] == pytest.approx(0.004 / 0.024)
    assert gpu_idle_figures((), 64) == {"measured": False}


def test_the_floor_of_w1_is_near_the_design_figure() -> None:
    # DESIGN.md: qwen3-0.6b in bf16 reads 1.19 GB of weights per step and 114,688 KV bytes per
    # token; W1 on 4.26 TB/s caps output near 90k tokens/s.
    model, workload = PRESETS["qwen3-0.6b"], WORKLOADS["W1"]
    figures = floors(model, workload)
    assert figures["num_steps"] == 512
    assert figures["weight_bytes"] == pytest.approx(1.19e9, rel=0.01)
    assert model.kv_bytes_per_token * 2 == 114688
    kv_tokens_per_request = 512 * 128 + 512 * 511 // 2
    assert figures["kv_bytes_read"] == 1024 * kv_tokens_per_request * 114688
    assert 85_000 < figures["roofline_output_tok_s"] < 95_000
    assert figures["compute_floor_s"] < figures["ideal_s"]  # W1 is bound by bandwidth
    w3 = floors(PRESETS["llama-3.1-8b"], WORKLOADS["W3"])
    assert w3["compute_floor_s"] > w3["ideal_s"]  # W3 by matmuls


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_a_moe_step_reads_the_active_experts_at_batch_1_and_all_of_them_at_large_batches(
    preset: str,
) -> None:
    model = PRESETS[preset]
    active, total = model.weight_bytes(2, active_only=True), model.weight_bytes(2)
    assert active < total / 2  # a few of many experts
    assert step_weight_bytes(model, 1) == pytest.approx(active)
    assert step_weight_bytes(model, 8) > step_weight_bytes(model, 2) > active
    assert step_weight_bytes(model, 1024) == pytest.approx(total, rel=1e-6)
    dense = PRESETS["qwen3-0.6b"]
    assert step_weight_bytes(dense, 1) == step_weight_bytes(dense, 1024) == dense.weight_bytes(2)


def test_a_transformers_model_that_cannot_be_built_is_reported_per_arm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import benchmarks.hf_arms
    from benchmarks.throughput_arms import _run_hf_arms

    def no_room(model: object) -> None:
        raise ValueError("needs 38.2 GB beside tandem, 24.0 GB free")

    monkeypatch.setattr(benchmarks.hf_arms, "hf_model_sharing_weights", no_room)
    details: dict = {"runs": []}
    _run_hf_arms(details, ["hf_static", "hf_continuous"], None, [[1, 2]], WORKLOADS["W4"], 8)
    assert [run["arm"] for run in details["runs"]] == ["hf_static", "hf_continuous"]
    assert all("38.2 GB" in run["error"] for run in details["runs"])


class _HFFittingBatches:
    """A stand-in for a transformers model whose `generate` runs out of device memory above
    `max_batch` rows."""

    device = torch.device("cpu")

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.batches: list[int] = []

    def generate(self, ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: object):
        if ids.shape[0] > self.max_batch:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.91 GiB.")
        self.batches.append(ids.shape[0])
        new_tokens = torch.zeros(ids.shape[0], int(kwargs["max_new_tokens"]), dtype=ids.dtype)
        return torch.cat([ids, new_tokens], dim=1)


def test_static_generate_halves_its_batch_until_it_fits() -> None:
    from benchmarks.hf_arms import run_hf_static_fitting

    prompts = [[1, 2, 3]] * 64
    hf = _HFFittingBatches(max_batch=20)
    run, too_large = run_hf_static_fitting(hf, prompts, 5, 64)
    assert too_large == [64, 32] and run.batch_size == 16
    assert hf.batches == [16] * 4 and run.num_output_tokens == 64 * 5

    with pytest.raises(torch.OutOfMemoryError):  # not even the smallest batch fits
        run_hf_static_fitting(_HFFittingBatches(max_batch=4), prompts, 5, 64)
