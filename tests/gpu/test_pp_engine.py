"""The pipeline-parallel engine on CPU: rank 0 (the first stage) in this process, the other
ranks spawned, gloo.

- PP 2 gives the greedy tokens, the seeded samples and the logprobs of one device in
  float32 on tiny llama (untied head) and qwen3 (tied head: the last stage loads the
  embedding as its head) checkpoints, with chunked prefill beside decodes; so do PP 3 over
  uneven stages, TP 2 x PP 2 (four ranks), the MoE models (gpt-oss's sliding windows go
  by each layer's index in the whole model), and prompt logprobs (computed by the last
  stage, reported by rank 0); over NCCL too where two GPUs exist;
- each stage holds and caches only its own layers;
- the V1 runner over TP 2, PP 2 and TP 2 x PP 2 ranks gives the tokens of one device too;
- killing the last stage's process mid-generation fails the running requests and the
  engine within a bounded time, and leaves no worker process behind;
- the sampler's last tables reach a first-stage rank that receives them late, though the
  sampler leaves the group right after its runner closes.
"""

from __future__ import annotations

import pytest

from actors.core.engine_startup import load_engine
from actors.protocol.config import ConfigError, EngineConfig
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.speculative_config import parse_speculative_config
from app.llm import LLM
from gpu.models.presets import PRESETS
from tests._embedded_model import needs_embedded_model
from tests.gpu._parallel_engine import (
    DEAD_WITHIN_S,
    ENGINE_OPTIONS,
    NCCL,
    PROMPTS,
    alive,
    kill_rank_mid_generation,
    outputs,
    run_ranks,
)
from tests.gpu._tiny_checkpoints import save_sharded, tiny_hf_model
from tests.gpu._tp_workers import late_receiver_rank
from tests.gpu.models._tiny_moe_models import TINY_MOE_SIZES, save_tiny_moe_checkpoint

pytestmark = pytest.mark.usefixtures("ranks_wait_passively")

PROMPT_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)


def _assert_same_outputs(single: list, staged: list) -> None:
    assert len({t for o in single for t in o.token_ids}) > 5, "a degenerate continuation"
    for one, pp in zip(single, staged, strict=True):
        assert pp.token_ids == one.token_ids
        assert (pp.logprobs is None) == (one.logprobs is None)
        for pp_entry, one_entry in zip(pp.logprobs or (), one.logprobs or (), strict=True):
            assert pp_entry.token_id == one_entry.token_id and pp_entry.rank == one_entry.rank
            assert pp_entry.logprob == pytest.approx(one_entry.logprob, abs=1e-4)
            assert [t.token_id for t in pp_entry.top_logprobs] == [
                t.token_id for t in one_entry.top_logprobs
            ]


def _prompt_logprobs(llm: LLM) -> list:
    return [
        [(e.token_id, round(e.logprob, 4)) for e in out.prompt_logprobs[1:]]
        for out in llm.generate(PROMPTS[:3], PROMPT_LOGPROBS)
    ]


@pytest.mark.parametrize("device", ["cpu", NCCL])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_pp2_engine_gives_the_tokens_and_logprobs_of_one_device(
    tmp_path, architecture, device
) -> None:
    save_sharded(tiny_hf_model(architecture), str(tmp_path))
    options = {**ENGINE_OPTIONS, "device": device, "dtype": "float32"}
    single_llm = LLM(str(tmp_path), **options)
    single, single_prompt = outputs(single_llm), _prompt_logprobs(single_llm)
    with LLM(str(tmp_path), pipeline_parallel_size=2, **options) as llm:
        assert llm.runner == "v2"
        model = llm.worker.model
        assert list(model.layer_indices) == [0] and len(llm.worker.kv_caches) == 1
        assert model.has_embedding and not model.has_head
        assert not {"model.norm.weight", "lm_head.weight"} & model.hf_weight_views().keys()
        pids = llm.worker.tp_leader.workers.pids
        assert len(alive(pids)) == 1
        staged, staged_prompt = outputs(llm), _prompt_logprobs(llm)
    assert alive(pids) == []  # close() leaves no worker behind
    _assert_same_outputs(single, staged)
    assert staged_prompt == single_prompt


@pytest.mark.parametrize(
    ("architecture", "num_layers", "tp_size", "pp_size"),
    [("qwen3", 2, 2, 2), ("llama", 5, 1, 3)],
)
def test_tp_by_pp_and_uneven_stages_give_the_tokens_of_one_device(
    tmp_path, architecture, num_layers, tp_size, pp_size
) -> None:
    save_sharded(tiny_hf_model(architecture, num_layers=num_layers), str(tmp_path))
    options = {**ENGINE_OPTIONS, "dtype": "float32"}
    single = outputs(LLM(str(tmp_path), **options))
    with LLM(
        str(tmp_path), tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size, **options
    ) as llm:
        assert len(llm.worker.tp_leader.workers.pids) == tp_size * pp_size - 1
        staged = outputs(llm)
    _assert_same_outputs(single, staged)


@pytest.mark.parametrize(("tp_size", "pp_size"), [(2, 1), (1, 2), (2, 2)])
def test_the_v1_runner_over_ranks_gives_the_tokens_of_one_device(
    tmp_path, tp_size, pp_size
) -> None:
    # V1 gathers the whole vocabulary's logits on each rank of the (last) stage and samples
    # them there; the last stage shares its tokens with the earlier ones.
    save_sharded(tiny_hf_model("qwen3"), str(tmp_path))
    options = {**ENGINE_OPTIONS, "dtype": "float32", "runner": "v1"}
    single = outputs(LLM(str(tmp_path), **options))
    with LLM(
        str(tmp_path), tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size, **options
    ) as llm:
        assert llm.runner == "v1"
        staged = outputs(llm)
    _assert_same_outputs(single, staged)


def test_v1_over_ranks_refuses_what_it_does_not_run_before_any_rank_starts() -> None:
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    with pytest.raises(ConfigError, match="--speculative-config with the V1 runner over"):
        load_engine(
            EngineConfig(
                model="dummy:qwen3-0.6b",
                device="cpu",
                runner="v1",
                tensor_parallel_size=2,
                speculative_config=spec,
            )
        )


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe_mixed"])
def test_moe_models_split_into_stages_give_the_tokens_of_one_device(tmp_path, name) -> None:
    save_tiny_moe_checkpoint(name, tmp_path)
    options = {**ENGINE_OPTIONS, "dtype": "float32"}
    vocab_size = TINY_MOE_SIZES["vocab_size"]
    single = outputs(LLM(str(tmp_path), **options), vocab_size)
    with LLM(str(tmp_path), pipeline_parallel_size=2, **options) as llm:
        assert list(llm.worker.model.layer_indices) == [0, 1]
        staged = outputs(llm, vocab_size)
    _assert_same_outputs(single, staged)


def test_a_killed_stage_fails_its_requests_and_the_engine_within_bounded_time(tmp_path) -> None:
    save_sharded(tiny_hf_model("llama"), str(tmp_path))
    loaded = load_engine(
        EngineConfig(model=str(tmp_path), pipeline_parallel_size=2, **ENGINE_OPTIONS)
    )
    pids = loaded.worker.tp_leader.workers.pids
    # the last stage: it samples every token
    finish_reason, elapsed_s, dead_reason = kill_rank_mid_generation(loaded, pids[0])
    assert finish_reason == "error"
    assert "rank 1" in dead_reason, dead_reason
    assert elapsed_s < DEAD_WITHIN_S
    assert alive(pids) == []


@pytest.mark.slow
@needs_embedded_model
def test_pp3_on_the_embedded_gguf_model_gives_the_greedy_tokens_of_one_device() -> None:
    # A GGUF file is read whole and each stage keeps its 10 of SmolLM2's 30 layers.
    prompts = ["The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    options = dict(device="cpu", quantization="none", max_model_len=128, num_kv_blocks=32)
    single = LLM("default", **options).generate(prompts, params)
    with LLM("default", pipeline_parallel_size=3, **options) as llm:
        assert list(llm.worker.model.layer_indices) == list(range(10))
        staged = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in staged] == [o.outputs[0].token_ids for o in single]


def test_a_first_stage_rank_behind_the_sampler_still_gets_its_last_table(tmp_path) -> None:
    # The sampler sends without waiting; without finishing its sends at close it would
    # leave while the receive was not yet posted, and that receive would fail.
    ranks = run_ranks(tmp_path, late_receiver_rank, 2, PRESETS["smollm2-135m"], 1.0)
    assert ranks == [[11, 12, 13], None]
