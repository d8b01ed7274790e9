"""Tensor parallelism over gloo on CPU: two (or three) spawned ranks against one device.

- collectives and the step broadcast deliver what they promise;
- TP = N gives the logits (to float32 rounding) and the greedy tokens of TP = 1 on dummy
  llama / qwen2 / qwen3 configs and on the embedded SmolLM2 GGUF;
- batch-sharded sampling (and the all-gather alternative) gives exactly the tokens,
  logprobs and ranks of unsharded sampling with the same seeds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actors.protocol.sampling_params import SamplingParams
from gpu.models.config import ModelConfig
from gpu.models.presets import PRESETS
from gpu.weights.dummy import dummy_weights
from gpu.weights.shard_loader import load_weight_shard
from tests._embedded_model import needs_embedded_model
from tests.gpu._parallel_engine import run_ranks
from tests.gpu._tp_workers import (
    GreedyRun,
    SamplingCase,
    case_inputs,
    collectives_rank,
    dummy_model_rank,
    model_file_rank,
    run_greedy,
    sampling_rank,
)

pytestmark = pytest.mark.usefixtures("ranks_wait_passively")


def test_collectives_and_the_step_broadcast(tmp_path) -> None:
    # Frames are 64 bytes here: the empty, inline and multi-frame payloads all occur.
    payloads = [b"step-1", b"", bytes(range(256)) * 3, b"x" * 48]
    rank0, rank1 = run_ranks(tmp_path, collectives_rank, 2, payloads)
    mine = [torch.arange(6, dtype=torch.float32).view(3, 2) + 100 * rank for rank in (0, 1)]
    for result in (rank0, rank1):
        assert torch.equal(result["all_reduce"], mine[0] + mine[1])
        assert torch.equal(result["all_gather"], torch.cat(mine))
    # Chunk d of rank s's input lands as chunk s of rank d's output.
    assert rank0["all_to_all"].tolist() == [0, 1, 100, 101]
    assert rank1["all_to_all"].tolist() == [2, 3, 102, 103]
    assert rank1["received"] == payloads
    assert rank1["object"] == {"step_id": 3, "request_ids": ["a", "b"]}
    assert rank1["after_shutdown"] is None


# ---- the model ------------------------------------------------------------------------


def _tiny(architecture: str, **changes: Any) -> ModelConfig:
    base = {
        "llama": PRESETS["llama-3.1-8b"],
        "qwen2": PRESETS["qwen2-0.5b"],
        "qwen3": PRESETS["qwen3-0.6b"],
    }[architecture]
    sizes = dict(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        head_dim=16,
        max_position_embeddings=256,
    )
    return base.replace(**{**sizes, **changes})


DUMMY_CASES = [
    # One KV head for two ranks: replicated. Odd vocabulary: the last shard is padded.
    (_tiny("llama", num_kv_heads=1), [[5, 17, 300, 2, 999], [42] * 9, [7, 8, 9]], 6),
    (_tiny("qwen2", num_kv_heads=2, tie_word_embeddings=False), [[1, 2, 3, 4], [900, 800, 700]], 5),
    (_tiny("qwen3", num_kv_heads=2, head_dim=32), [[11, 12, 13], [600] * 6, [3], [77, 78]], 5),
]


def _assert_same_run(tp: GreedyRun, single: GreedyRun) -> None:
    torch.testing.assert_close(tp.prompt_logits, single.prompt_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tp.tokens, single.tokens)


def test_tp2_dummy_models_match_one_device(tmp_path) -> None:
    ranks = run_ranks(tmp_path, dummy_model_rank, 2, DUMMY_CASES)
    for index, (config, prompts, num_steps) in enumerate(DUMMY_CASES):
        single = run_greedy(
            config, dummy_weights(config, torch.float32, "cpu", seed=5), prompts, num_steps
        )
        if not config.tie_word_embeddings:  # a random tied model repeats its input token
            assert len(set(single.tokens.reshape(-1).tolist())) > 3, "a degenerate continuation"
        for rank_runs in ranks:
            _assert_same_run(rank_runs[index], single)


@pytest.mark.slow
@needs_embedded_model
def test_tp3_embedded_gguf_matches_one_device(tmp_path) -> None:
    # SmolLM2-135M has 9 query and 3 KV heads: TP 3 is the size that divides them.
    prompts = [[1, 9690, 314, 253, 1167], [504, 3458, 282, 4649, 314], [28, 29, 30]]
    shard = load_weight_shard("default", torch.float32, "cpu", 0, 1)
    single = run_greedy(shard.config, shard.weights, prompts, 4)
    for run in run_ranks(tmp_path, model_file_rank, 3, "default", prompts, 4):
        _assert_same_run(run, single)


# ---- sampling -------------------------------------------------------------------------

_ROWS = [5, 2, 9, 0, 11, 3, 7]
SAMPLING_CASES = {
    "greedy": SamplingCase(
        1001, {r: SamplingParams(temperature=0.0) for r in _ROWS}, _ROWS, None, 1
    ),
    "seeded_temperature": SamplingCase(
        1000, {r: SamplingParams(temperature=0.8, seed=100 + r) for r in _ROWS}, _ROWS, None, 2
    ),
    "top_p_and_greedy_with_logprobs": SamplingCase(
        1001,
        {
            r: (
                SamplingParams(temperature=1.3, top_p=0.9, seed=r)
                if r % 2
                else SamplingParams(temperature=0.0)
            )
            for r in _ROWS
        },
        _ROWS,
        3,
        3,
    ),
    "top_k_top_p_min_p": SamplingCase(
        999,
        {
            r: SamplingParams(temperature=0.7, top_k=5 + r, top_p=0.8, min_p=0.05 * (r % 3))
            for r in _ROWS
        },
        _ROWS,
        0,
        4,
    ),
    "penalties_bias_min_tokens": SamplingCase(
        1001,
        {
            r: SamplingParams(
                temperature=1.0,
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                presence_penalty=0.4,
                logit_bias=((r, 5.0),),
                min_tokens=4,
            )
            for r in _ROWS
        },
        _ROWS,
        2,
        5,
    ),
    "one_row_for_two_ranks": SamplingCase(
        1001, {4: SamplingParams(temperature=0.9, seed=4)}, [4], 1, 6
    ),
}


def _assert_same_output(got: Any, expected: Any) -> None:
    for field in ("sampled_token_ids", "logprob_token_ids", "logprobs", "sampled_ranks"):
        got_value, expected_value = getattr(got, field), getattr(expected, field)
        assert (got_value is None) == (expected_value is None), field
        if expected_value is not None:
            assert got_value.dtype == expected_value.dtype, field
            assert torch.equal(got_value, expected_value), field


def _check_batch_sharded_sampling(tmp_path, device_kind: str) -> None:
    cases = list(SAMPLING_CASES.values())
    ranks = run_ranks(tmp_path, sampling_rank, 2, cases, device_kind)
    reference_device = "cuda:0" if device_kind == "cuda" else "cpu"
    for index, (name, case) in enumerate(SAMPLING_CASES.items()):
        sampler, logits, args = case_inputs(case, reference_device)
        expected = sampler(logits, **args)
        expected = type(expected)(
            *(
                None if t is None else t.cpu()
                for t in (
                    expected.sampled_token_ids,
                    expected.logprob_token_ids,
                    expected.logprobs,
                    expected.sampled_ranks,
                )
            )
        )
        if len(case.rows) > 1:
            assert len(set(expected.sampled_token_ids.tolist())) > 1, name
        for rank_outputs in ranks:
            sharded, gathered = rank_outputs[index]
            _assert_same_output(sharded, expected)
            _assert_same_output(gathered, expected)


def test_batch_sharded_sampling_gives_exactly_the_unsharded_tokens(tmp_path) -> None:
    _check_batch_sharded_sampling(tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_batch_sharded_sampling_over_nccl(tmp_path) -> None:
    _check_batch_sharded_sampling(tmp_path, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_dummy_models_over_nccl_match_one_device(tmp_path) -> None:
    ranks = run_ranks(tmp_path, dummy_model_rank, 2, DUMMY_CASES, "cuda")
    for index, (config, prompts, num_steps) in enumerate(DUMMY_CASES):
        single = run_greedy(
            config,
            dummy_weights(config, torch.float32, "cuda:0", seed=5),
            prompts,
            num_steps,
            device="cuda:0",
        )
        for rank_runs in ranks:
            _assert_same_run(rank_runs[index], single)
