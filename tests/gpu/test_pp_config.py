"""--pipeline-parallel-size: the flag, the stage layout, and the refusals before any weight
loads."""

from __future__ import annotations

import pytest
import torch

from actors.core.engine_startup import load_engine, selection_input
from actors.protocol.config import ConfigError, EngineConfig
from actors.protocol.speculative_config import parse_speculative_config
from gpu.distributed.layout import ParallelLayout, stage_layers
from gpu.distributed.tp_config import TensorParallelError, validate_tensor_parallel
from gpu.kv_sizing import kv_bytes_per_block
from gpu.models.presets import PRESETS
from gpu.platform import probe_platform
from gpu.runner_selection import RunnerSelectionError, select_runner
from gpu.weights.dummy import dummy_weights
from gpu.weights.layout import EMBED_NAME, FINAL_NORM_NAME, LM_HEAD_NAME
from tests._engine_flags import config_from_flags

LLAMA_8B = PRESETS["llama-3.1-8b"]


def test_the_flag_its_short_form_and_its_environment_variable(monkeypatch) -> None:
    assert config_from_flags().pipeline_parallel_size == 1
    assert config_from_flags("--pipeline-parallel-size", "4").pipeline_parallel_size == 4
    config = config_from_flags("-pp", "2", "-tp", "2")
    assert (config.pipeline_parallel_size, config.num_ranks) == (2, 4)
    monkeypatch.setenv("TANDEM_PIPELINE_PARALLEL_SIZE", "3")
    assert config_from_flags().pipeline_parallel_size == 3
    assert config_from_flags().distributed_timeout_s == 120.0
    assert config_from_flags("--distributed-timeout-seconds", "7.5").distributed_timeout_s == 7.5
    with pytest.raises(ConfigError, match="distributed_timeout_s must be positive"):
        EngineConfig(distributed_timeout_s=0)
    with pytest.raises(ConfigError, match="pipeline_parallel_size must be an integer >= 1"):
        EngineConfig(pipeline_parallel_size=0)


@pytest.mark.parametrize(("num_layers", "pp_size"), [(2, 2), (7, 3), (32, 4), (30, 4), (5, 5)])
def test_stages_take_every_layer_once_in_order_and_within_one_of_each_other(
    num_layers, pp_size
) -> None:
    stages = [stage_layers(num_layers, pp_size, s) for s in range(pp_size)]
    assert [i for stage in stages for i in stage] == list(range(num_layers))
    sizes = [len(stage) for stage in stages]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # extras on the earliest stages


def test_ranks_are_stage_major() -> None:
    layout = ParallelLayout(tp_size=2, pp_size=3)
    assert layout.world_size == 6
    assert [(layout.pp_rank(r), layout.tp_rank(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1),
    ]  # fmt: skip
    assert layout.stage_ranks(1) == [2, 3]
    with pytest.raises(ValueError, match="cannot be split over 3"):
        stage_layers(2, 3, 0)


@pytest.mark.parametrize(
    ("tp_size", "pp_size", "device_type", "device", "num_devices", "message"),
    [
        (1, 33, "cpu", "cpu", 0, "has 32 layers, fewer than one per stage"),
        (2, 2, "cuda", "cuda", 2, "--tensor-parallel-size 2 with --pipeline-parallel-size 2 "
         "needs 4 GPUs, but 2 are visible"),
        (1, 2, "cuda", "cuda", 1, "--pipeline-parallel-size 2 needs 2 GPUs, but 1 is visible"),
        (1, 2, "cuda", "cuda:1", 8, "--device cuda:1 names one GPU"),
        (1, 0, "cpu", "cpu", 0, "--pipeline-parallel-size must be at least 1"),
    ],
)  # fmt: skip
def test_sizes_the_model_or_the_machine_cannot_take(
    tp_size, pp_size, device_type, device, num_devices, message
) -> None:
    with pytest.raises(TensorParallelError, match=message):
        validate_tensor_parallel(
            tp_size, LLAMA_8B, device_type, device, num_devices, pp_size=pp_size
        )


def test_sizes_that_fit() -> None:
    validate_tensor_parallel(2, LLAMA_8B, "cuda", "auto", 8, pp_size=4)
    validate_tensor_parallel(1, LLAMA_8B, "cpu", "cpu", 0, pp_size=32)


def test_a_stage_sizes_its_kv_blocks_by_its_own_layers() -> None:
    whole = kv_bytes_per_block(LLAMA_8B, 8, 16, torch.bfloat16)
    assert kv_bytes_per_block(LLAMA_8B, 8, 16, torch.bfloat16, num_layers=8) * 4 == whole
    assert whole == 32 * 2 * 8 * 128 * 2 * 16


def test_a_stages_dummy_weights_are_those_of_the_whole_model() -> None:
    config = PRESETS["qwen3-0.6b"].replace(num_layers=3, vocab_size=256)  # tied head
    whole = dummy_weights(config, torch.float32)
    last_stage = {f"model.layers.2.{n}" for n in ("input_layernorm.weight",)}
    kept = dummy_weights(
        config,
        torch.float32,
        keep=lambda n: (
            n.startswith("model.layers.2.") or n in {EMBED_NAME, FINAL_NORM_NAME, LM_HEAD_NAME}
        ),
    )
    assert last_stage <= kept.keys()
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in kept)
    for name, tensor in kept.items():
        assert torch.equal(tensor, whole[name]), name


def test_speculative_decoding_and_the_offload_tiers_are_refused_with_pipelines() -> None:
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    with pytest.raises(ConfigError, match="speculative decoding does not run with"):
        EngineConfig(pipeline_parallel_size=2, speculative_config=spec)
    with pytest.raises(ConfigError, match="--pipeline-parallel-size > 1 yet"):
        EngineConfig(pipeline_parallel_size=2, kv_offload_cpu_bytes=1 << 30)


def test_startup_refuses_pipelines_the_runner_cannot_run_before_loading() -> None:
    with pytest.raises(RunnerSelectionError, match="stock torch.compile"):
        load_engine(
            EngineConfig(
                model="dummy:qwen3-0.6b",
                device="cpu",
                runner="v2",
                pipeline_parallel_size=2,
                compile_level=1,
            )
        )


@pytest.mark.parametrize(
    ("argv", "feature"),
    [
        (("-tp", "2", "--enable-sequence-parallelism"), "sequence parallelism"),
        (
            ("-pp", "2", "--distributed-executor-backend", "external_launcher"),
            "pipeline parallelism with external_launcher",
        ),
    ],
)
def test_the_real_flags_fire_the_v1_rule_of_vllm(argv, feature) -> None:
    config = config_from_flags("--model", "dummy:qwen3-0.6b", "--device", "cpu", *argv)
    choice = select_runner(selection_input(config, "qwen3"), probe_platform("cpu"))
    assert (choice.runner, choice.rule) == ("v1", "unsupported_features")
    assert feature in choice.reason
    forced = selection_input(config.replace(runner="v2"), "qwen3")
    assert select_runner(forced, probe_platform("cpu")).runner == "v2"
