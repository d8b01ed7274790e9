"""Sequence parallelism over gloo on CPU: the residual stream sharded along tokens.

- the reduce-scatter and the token-shard helpers (padding to a multiple of the TP size)
  give what a reference computes;
- with sequence parallelism TP 2 and TP 3 give the logits (to float32 rounding) and the
  greedy tokens of plain TP on dummy llama / qwen2 / qwen3 configs, with token counts that
  are not multiples of the TP size, one token among them;
- across pipeline stages (TP 2 x PP 2) the last stage's logits are those without it;
- the TP 2 engine (V1 or V2) gives the tokens and logprobs it gives without it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.llm import LLM
from gpu.models.config import ModelConfig
from gpu.models.parallel_layers import pad_tokens, padded_num_tokens, token_shard
from gpu.models.presets import PRESETS
from gpu.models.sequence_parallel import TokenSharded
from tests.gpu._parallel_engine import ENGINE_OPTIONS, GREEDY, PROMPTS, outputs, run_ranks
from tests.gpu._tiny_checkpoints import save_sharded, tiny_hf_model
from tests.gpu._tp_workers import (
    PipelineStep,
    pipeline_sequence_parallel_rank,
    sequence_parallel_rank,
    token_collectives_rank,
)

pytestmark = pytest.mark.usefixtures("ranks_wait_passively")


# ---- the collectives and the token shards -------------------------------------------


def test_token_shards_pad_to_a_multiple_of_the_tp_size() -> None:
    assert [padded_num_tokens(t, 3) for t in (1, 3, 4, 7)] == [3, 3, 6, 9]
    full = torch.arange(8.0).view(4, 2)
    assert pad_tokens(full, 4) is full
    assert torch.equal(pad_tokens(full, 6), torch.cat((full, torch.zeros(2, 2))))
    shards = [token_shard(full, SimpleNamespace(rank=r, world_size=3)) for r in range(3)]
    assert [s.tolist() for s in shards] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 0], [0, 0]]]
    one = [token_shard(full[:1], SimpleNamespace(rank=r, world_size=2)) for r in range(2)]
    assert [s.tolist() for s in one] == [[[0, 1]], [[0, 0]]]


def test_reduce_scatter_and_token_collectives_over_gloo(tmp_path) -> None:
    ranks = run_ranks(tmp_path, token_collectives_rank, 2)
    mine = [torch.arange(8, dtype=torch.float32).view(4, 2) + 100 * r for r in (0, 1)]
    total = mine[0] + mine[1]
    # Three tokens pad to four: rank 0 holds tokens 0-1 of the sum, rank 1 token 2 and a zero.
    partials = [torch.arange(30, dtype=torch.float32).view(3, 2, 5) * (r + 1) for r in (0, 1)]
    padded_sum = torch.cat((partials[0] + partials[1], torch.zeros(1, 2, 5)))
    for rank, result in enumerate(ranks):
        assert torch.equal(result["reduce_scatter"], total[2 * rank : 2 * rank + 2])
        assert result["reduce_scatter_bf16"].dtype == torch.bfloat16
        assert torch.equal(result["reduce_scatter_bf16"].float(), total[2 * rank : 2 * rank + 2])
        assert torch.equal(result["token_shard_of_sum"], padded_sum[2 * rank : 2 * rank + 2])
        assert torch.equal(result["gathered"], padded_sum[:3])
        assert torch.equal(result["one_token"], padded_sum[:1])
        expected_shard = torch.cat((torch.arange(12.0).view(3, 4), torch.zeros(1, 4)))
        assert torch.equal(result["token_shard"], expected_shard[2 * rank : 2 * rank + 2])
        assert "multiple of 2 rows, got 5" in result["uneven_error"]


# ---- the model ------------------------------------------------------------------------


def _tiny(preset: str, **changes: Any) -> ModelConfig:
    sizes = dict(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        head_dim=16,
        max_position_embeddings=256,
    )
    return PRESETS[preset].replace(**{**sizes, **changes})


# Prefill of 17 / 7 / 1 tokens, then decodes of 3 / 2 / 1: padded where TP 2 does not divide.
TP2_CASES = [
    (_tiny("llama-3.1-8b", num_kv_heads=1), [[5, 17, 300, 2, 999], [42] * 9, [7, 8, 9]], 5),
    (
        _tiny("qwen2-0.5b", num_kv_heads=2, tie_word_embeddings=False),
        [[1, 2, 3, 4], [900, 80, 7]],
        4,
    ),
    (_tiny("qwen3-0.6b", num_kv_heads=2, head_dim=32), [[11]], 4),
]
# Six heads over three ranks, one KV head each; 7 prompt tokens, then decodes of 2 (< TP 3).
TP3_CASES = [
    (
        _tiny("qwen3-0.6b", num_heads=6, num_kv_heads=3, tie_word_embeddings=False),
        [[5, 6], [7] * 5],
        4,
    )
]


def _assert_sequence_parallel_matches(ranks: list[Any], cases: list) -> None:
    for rank_runs in ranks:
        for (_, prompts, _), (plain, sharded) in zip(cases, rank_runs, strict=True):
            torch.testing.assert_close(
                sharded.prompt_logits, plain.prompt_logits, rtol=1e-4, atol=1e-4
            )
            assert torch.equal(sharded.tokens, plain.tokens), prompts
    tokens = ranks[0][0][0].tokens
    assert len(set(tokens.reshape(-1).tolist())) > 3, "a degenerate continuation"


def test_tp2_sequence_parallel_gives_the_logits_and_tokens_of_plain_tp(tmp_path) -> None:
    _assert_sequence_parallel_matches(
        run_ranks(tmp_path, sequence_parallel_rank, 2, TP2_CASES), TP2_CASES
    )


def test_tp3_sequence_parallel_gives_the_logits_and_tokens_of_plain_tp(tmp_path) -> None:
    _assert_sequence_parallel_matches(
        run_ranks(tmp_path, sequence_parallel_rank, 3, TP3_CASES), TP3_CASES
    )


def test_pipeline_stages_carry_the_whole_stream_under_sequence_parallelism(tmp_path) -> None:
    # TP 2 x PP 2 over four layers; 5 tokens, then 2 + 1 padding (as a CUDA graph pads), then 1.
    config = _tiny("llama-3.1-8b", num_kv_heads=2, num_layers=4)
    steps: list[PipelineStep] = [
        ([("a", [5, 17, 300]), ("b", [42, 43])], 0),
        ([("a", [9]), ("b", [10])], 1),
        ([("a", [11])], 0),
    ]
    ranks = run_ranks(tmp_path, pipeline_sequence_parallel_rank, 4, config, steps)
    assert ranks[0] is None and ranks[1] is None  # the first stage's ranks
    for plain, sharded in ranks[2:]:
        assert [t.shape[0] for t in sharded] == [5, 2, 1]
        for without, with_sp in zip(plain, sharded, strict=True):
            torch.testing.assert_close(with_sp, without, rtol=1e-4, atol=1e-4)
    assert torch.equal(ranks[2][1][0], ranks[3][1][0])  # both TP ranks see every token


# ---- the engine -----------------------------------------------------------------------


@pytest.mark.parametrize("runner", ["v1", "v2"])  # V1 is what "auto" picks for it
def test_tp2_engine_with_sequence_parallelism_gives_the_tokens_and_logprobs_without(
    tmp_path, runner
) -> None:
    hf_model = tiny_hf_model("llama")
    save_sharded(hf_model, str(tmp_path))
    options: dict[str, Any] = {
        **ENGINE_OPTIONS,
        "dtype": "float32",
        "tensor_parallel_size": 2,
        "runner": runner,
        "enable_prompt_embeds": True,
    }
    with LLM(str(tmp_path), **options) as llm:
        plain = outputs(llm)
    # Prompt embeddings land in the token shards too: rows in place of a prompt's ids.
    table = hf_model.get_input_embeddings().weight.detach()
    embeds: list[Any] = [{"prompt_embeds": table[torch.tensor(PROMPTS[1])].clone()}, PROMPTS[2]]
    with LLM(str(tmp_path), enable_sequence_parallelism=True, **options) as llm:
        assert llm.runner == runner and isinstance(llm.worker.model.layout, TokenSharded)
        sharded = outputs(llm)
        from_embeds = [o.outputs[0] for o in llm.generate(embeds, GREEDY)]
    assert [o.token_ids for o in from_embeds] == [o.token_ids for o in plain[1:3]]
    assert len({t for o in plain for t in o.token_ids}) > 5, "a degenerate continuation"
    for one, sp in zip(plain, sharded, strict=True):
        assert sp.token_ids == one.token_ids
        assert (sp.logprobs is None) == (one.logprobs is None)
        for sp_entry, one_entry in zip(sp.logprobs or (), one.logprobs or (), strict=True):
            assert sp_entry.token_id == one_entry.token_id and sp_entry.rank == one_entry.rank
            assert sp_entry.logprob == pytest.approx(one_entry.logprob, abs=1e-4)
