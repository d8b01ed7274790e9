"""KV cache sizing from measured memory: the runner-state term on CPU; on a GPU, every term
of a real startup is positive and plausible, the graphs are captured, and a step at the
largest batch runs without running out of memory."""

from __future__ import annotations

import gc

import pytest
import torch

from gpu.kv_sizing import StepShape, runner_state_bytes
from gpu.models.presets import PRESETS


def test_runner_state_counts_the_penalty_rows_allocated_after_startup() -> None:
    # The row tables (token history, block table) belong to the V2 step state, allocated
    # before the measurement and counted with the weights.
    model = PRESETS["qwen3-0.6b"]
    shape = StepShape(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100, block_size=16)
    penalties = 4 * model.vocab_size * 5  # bool prompt mask + int32 output counts
    assert runner_state_bytes(model, shape) == penalties + (1 << 20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_startup_measures_every_term_and_the_largest_batch_fits() -> None:
    from actors.protocol.sampling_params import SamplingParams
    from app.llm import LLM

    gc.collect()  # earlier tests' engines, held by reference cycles
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated_before = torch.cuda.memory_allocated()  # earlier tests' live tensors, if any
    # The other lane parts' processes count as non-torch memory here, and at 0.4 of the
    # device they once left this engine no KV: room for what they hold now, plus 0.25
    # of the device for their growth and this small model.
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    utilization = min(0.95, 1 - free_bytes / total_bytes + 0.25)
    llm = LLM(
        "dummy:qwen3-0.6b",
        runner="v2",
        dtype="bfloat16",
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=1024,
        gpu_memory_utilization=utilization,
    )
    worker = llm.worker
    report = worker.memory_report
    assert report is not None and worker.graphs is not None
    num_params = worker.model_config.num_params()
    assert 0.95 * 2 * num_params < report.weights_bytes - allocated_before < 1.1 * 2 * num_params
    assert report.activation_peak_bytes > 0 and report.graph_estimate_bytes > 0
    assert report.non_torch_bytes > 0 and report.kv_budget_bytes > 0
    assert worker.kv_spec.num_bytes <= report.kv_budget_bytes
    total_planned = (
        report.weights_bytes
        + report.activation_peak_bytes
        + report.graph_estimate_bytes
        + report.non_torch_bytes
        + report.runner_state_bytes
        + report.kv_budget_bytes
    )
    assert total_planned <= utilization * report.total_bytes + (1 << 20)
    sizes = worker.graphs.sizes
    assert worker.graphs.num_captured == 4 * len(sizes.decode) + len(sizes.mixed)
    assert 0 < worker.graph_memory_bytes < 4 * report.graph_estimate_bytes + (256 << 20)
    prompts = [[(7 * i + j) % 1000 for j in range(100)] for i in range(64)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
