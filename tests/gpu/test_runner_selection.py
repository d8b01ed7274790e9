from __future__ import annotations

import dataclasses
import logging

import pytest

import gpu.runner_selection as selection
from gpu.platform import Platform
from gpu.runner_selection import (
    RunnerSelectionError,
    RunnerSelectionInput,
    parse_runner_env,
    select_runner,
)

HEALTHY_GPU = Platform(
    device_type="cuda",
    device="cuda:0",
    device_name="NVIDIA H200",
    compute_capability=(9, 0),
    total_memory_bytes=140 << 30,
    free_memory_bytes=139 << 30,
    has_triton=True,
    pin_memory_available=True,
    uva_available=True,
    is_wsl=False,
)
CPU_ONLY = Platform(
    device_type="cpu",
    device="cpu",
    device_name="x86_64",
    compute_capability=None,
    total_memory_bytes=16 << 30,
    free_memory_bytes=8 << 30,
    has_triton=False,
    pin_memory_available=False,
    uva_available=False,
    is_wsl=False,
)
GPU_WITHOUT_TRITON = dataclasses.replace(HEALTHY_GPU, has_triton=False)
WSL_GPU = dataclasses.replace(
    HEALTHY_GPU, is_wsl=True, pin_memory_available=False, uva_available=False
)
PLAIN = RunnerSelectionInput(architecture="llama")


@pytest.fixture
def warnings_logged(caplog: pytest.LogCaptureFixture) -> _Warnings:
    caplog.set_level(logging.WARNING, logger=selection.__name__)
    return _Warnings(caplog)


class _Warnings:
    """The selection module's warnings logged so far in the running test."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    def messages(self) -> list[str]:
        return [
            r.getMessage()
            for r in self._caplog.get_records("call")
            if r.name == selection.__name__ and r.levelno == logging.WARNING
        ]


def _config(**changes) -> RunnerSelectionInput:
    return dataclasses.replace(PLAIN, **changes)


# Rule 6 -------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", [HEALTHY_GPU, CPU_ONLY], ids=["gpu", "cpu"])
def test_rule6_v2_by_default_without_warnings(
    platform: Platform, warnings_logged: _Warnings
) -> None:
    choice = select_runner(PLAIN, platform)
    assert (choice.runner, choice.rule) == ("v2", "default")
    assert warnings_logged.messages() == []


def test_cpu_runs_v2_without_triton_or_pinned_memory() -> None:
    # Rules 3 and 4 are about GPUs; on CPU the V2 runner uses the torch references.
    assert select_runner(PLAIN, CPU_ONLY).runner == "v2"


# Rule 1 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "runner"),
    [
        ({"env_override": False}, "v1"),
        ({"env_override": True}, "v2"),
        ({"requested_runner": "v1"}, "v1"),
        ({"requested_runner": "v2"}, "v2"),
        ({"env_override": True, "requested_runner": "v2"}, "v2"),
    ],
)
def test_rule1_explicit_request_picks_that_runner(
    changes: dict, runner: str, warnings_logged: _Warnings
) -> None:
    choice = select_runner(_config(**changes), HEALTHY_GPU)
    assert (choice.runner, choice.rule) == (runner, "override")
    assert "forced by" in choice.reason
    assert warnings_logged.messages() == []


def test_rule1_forced_v1_wins_over_the_default_and_forced_v2_over_later_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        selection, "V2_UNSUPPORTED_PLATFORM_ARCHITECTURES", frozenset({("cuda", "llama")})
    )
    assert select_runner(_config(env_override=True), HEALTHY_GPU).runner == "v2"
    assert select_runner(_config(env_override=False), HEALTHY_GPU).runner == "v1"
    # Forced V1 also runs where rules 3-5 would have fallen back anyway.
    forced_v1 = select_runner(
        _config(requested_runner="v1", sequence_parallel=True), GPU_WITHOUT_TRITON
    )
    assert (forced_v1.runner, forced_v1.rule) == ("v1", "override")


def test_env_and_flag_that_disagree_are_an_error() -> None:
    with pytest.raises(
        RunnerSelectionError,
        match="TANDEM_USE_V2_MODEL_RUNNER asks for the V2 .* --runner asks for v1",
    ):
        select_runner(_config(env_override=True, requested_runner="v1"), HEALTHY_GPU)


@pytest.mark.parametrize(
    ("platform", "changes", "why"),
    [
        (GPU_WITHOUT_TRITON, {}, "Triton is missing"),
        (WSL_GPU, {}, r"pinned host memory is unavailable \(WSL2\)"),
        (dataclasses.replace(HEALTHY_GPU, uva_available=False), {}, "UVA access"),
        (HEALTHY_GPU, {"compilation_mode": "stock_torch_compile"}, "stock torch.compile"),
        (
            HEALTHY_GPU,
            {"custom_logits_processors": ("my.Proc",)},
            r"custom logits processors \(my.Proc\)",
        ),
    ],
)
def test_forcing_v2_where_it_cannot_run_is_an_error(
    platform: Platform, changes: dict, why: str
) -> None:
    with pytest.raises(
        RunnerSelectionError, match=f"forces the V2 runner, which cannot run here: .*{why}"
    ):
        select_runner(_config(env_override=True, **changes), platform)
    with pytest.raises(RunnerSelectionError, match=why):
        select_runner(_config(requested_runner="v2", **changes), platform)


def test_forcing_v2_on_cpu_is_allowed() -> None:
    assert select_runner(_config(requested_runner="v2"), CPU_ONLY).runner == "v2"


def test_forcing_v1_with_a_v2_only_feature_is_an_error() -> None:
    with pytest.raises(
        RunnerSelectionError, match="forces the V1 runner, which does not support: overlap_trace"
    ):
        select_runner(_config(env_override=False, v2_only_features=("overlap_trace",)), HEALTHY_GPU)
    assert (
        select_runner(
            _config(env_override=True, v2_only_features=("overlap_trace",)), HEALTHY_GPU
        ).runner
        == "v2"
    )


# Rules 2-5 ----------------------------------------------------------------------------


def test_rule2_listed_platform_architecture_pair_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        selection, "V2_UNSUPPORTED_PLATFORM_ARCHITECTURES", frozenset({("cuda", "qwen3")})
    )
    choice = select_runner(_config(architecture="qwen3"), HEALTHY_GPU)
    assert (choice.runner, choice.rule) == ("v1", "platform_architecture")
    assert "qwen3" in choice.reason
    assert select_runner(_config(architecture="llama"), HEALTHY_GPU).runner == "v2"
    assert select_runner(_config(architecture="qwen3"), CPU_ONLY).runner == "v2"


def test_rule3_gpu_without_triton_falls_back() -> None:
    choice = select_runner(PLAIN, GPU_WITHOUT_TRITON)
    assert (choice.runner, choice.rule) == ("v1", "triton")


@pytest.mark.parametrize(
    "platform",
    [WSL_GPU, dataclasses.replace(HEALTHY_GPU, uva_available=False)],
    ids=["wsl2-no-pinned-memory", "no-uva"],
)
def test_rule4_gpu_without_pinned_memory_or_uva_falls_back(platform: Platform) -> None:
    choice = select_runner(PLAIN, platform)
    assert (choice.runner, choice.rule) == ("v1", "pinned_memory")


@pytest.mark.parametrize(
    ("changes", "feature"),
    [
        ({"compilation_mode": "stock_torch_compile"}, "stock torch.compile"),
        ({"sequence_parallel": True}, "sequence parallelism"),
        (
            {"pipeline_parallel_size": 2, "distributed_executor_backend": "external_launcher"},
            "pipeline parallelism with external_launcher",
        ),
        ({"custom_logits_processors": ("a.B", "c.D")}, "custom logits processors (a.B, c.D)"),
    ],
)
def test_rule5_unsupported_feature_falls_back(changes: dict, feature: str) -> None:
    choice = select_runner(_config(**changes), HEALTHY_GPU)
    assert (choice.runner, choice.rule) == ("v1", "unsupported_features")
    assert feature in choice.reason


@pytest.mark.parametrize(
    "changes",
    [
        {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"},
        {"pipeline_parallel_size": 1, "distributed_executor_backend": "external_launcher"},
        {"speculative_method": "eagle"},
        {"speculative_method": "ngram"},
        {"speculative_method": "ngram_gpu"},
    ],
)
def test_rule5_leaves_supported_neighbours_on_v2(changes: dict) -> None:
    assert select_runner(_config(**changes), HEALTHY_GPU).runner == "v2"


def test_rules_apply_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        selection, "V2_UNSUPPORTED_PLATFORM_ARCHITECTURES", frozenset({("cuda", "llama")})
    )
    everything_wrong = dataclasses.replace(
        GPU_WITHOUT_TRITON, pin_memory_available=False, uva_available=False
    )
    with_feature = _config(sequence_parallel=True)
    assert select_runner(with_feature, everything_wrong).rule == "platform_architecture"
    monkeypatch.setattr(selection, "V2_UNSUPPORTED_PLATFORM_ARCHITECTURES", frozenset())
    assert select_runner(with_feature, everything_wrong).rule == "triton"
    assert (
        select_runner(with_feature, dataclasses.replace(everything_wrong, has_triton=True)).rule
        == "pinned_memory"
    )
    assert select_runner(with_feature, HEALTHY_GPU).rule == "unsupported_features"


def test_fallback_with_a_v2_only_feature_is_an_error_not_a_silent_downgrade() -> None:
    with pytest.raises(
        RunnerSelectionError, match=r"overlap_trace need the V2 runner, but rule 3 \(triton\)"
    ):
        select_runner(_config(v2_only_features=("overlap_trace",)), GPU_WITHOUT_TRITON)


# Warnings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "platform", "rule_text"),
    [
        (PLAIN, GPU_WITHOUT_TRITON, "rule 3 (triton)"),
        (PLAIN, WSL_GPU, "rule 4 (pinned_memory)"),
        (_config(custom_logits_processors=("a.B",)), HEALTHY_GPU, "rule 5 (unsupported_features)"),
    ],
)
def test_each_fallback_logs_exactly_one_warning_naming_the_rule(
    config: RunnerSelectionInput, platform: Platform, rule_text: str, warnings_logged: _Warnings
) -> None:
    choice = select_runner(config, platform)
    (message,) = warnings_logged.messages()
    assert rule_text in message and choice.reason in message and "V1" in message


def test_rule2_fallback_logs_one_warning(
    monkeypatch: pytest.MonkeyPatch, warnings_logged: _Warnings
) -> None:
    monkeypatch.setattr(
        selection, "V2_UNSUPPORTED_PLATFORM_ARCHITECTURES", frozenset({("cuda", "llama")})
    )
    select_runner(PLAIN, HEALTHY_GPU)
    assert [m.split(":")[0] for m in warnings_logged.messages()] == [
        "runner selection rule 2 (platform_architecture)"
    ]


# Parsing and validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("  ", None),
        ("1", True),
        ("true", True),
        (" On ", True),
        ("0", False),
        ("FALSE", False),
        ("no", False),
    ],
)
def test_parse_runner_env(value: str | None, expected: bool | None) -> None:
    assert parse_runner_env(value) is expected


@pytest.mark.parametrize("value", ["2", "v2", "maybe", "1.0"])
def test_parse_runner_env_rejects_junk(value: str) -> None:
    with pytest.raises(
        RunnerSelectionError, match=f"TANDEM_USE_V2_MODEL_RUNNER must be 1 .* got '{value}'"
    ):
        parse_runner_env(value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"requested_runner": "v3"}, "--runner must be auto, v1 or v2"),
        ({"compilation_mode": "inductor"}, "compilation_mode must be"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be at least 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1"),
    ],
)
def test_selection_input_rejects_bad_values(changes: dict, message: str) -> None:
    with pytest.raises(RunnerSelectionError, match=message):
        RunnerSelectionInput(architecture="llama", **changes)


# Tensor parallelism -------------------------------------------------------------------


@pytest.mark.parametrize("platform", [HEALTHY_GPU, CPU_ONLY], ids=["gpu", "cpu"])
def test_tensor_parallelism_runs_on_v2_by_default(
    platform: Platform, warnings_logged: _Warnings
) -> None:
    choice = select_runner(_config(tensor_parallel_size=2), platform)
    assert (choice.runner, choice.rule) == ("v2", "default")
    assert warnings_logged.messages() == []


@pytest.mark.parametrize(
    "force", [{"requested_runner": "v1"}, {"env_override": False}], ids=["flag", "env"]
)
@pytest.mark.parametrize(
    "sizes", [{"tensor_parallel_size": 4}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"]
)
def test_v1_runs_tensor_and_pipeline_parallelism_when_forced(force: dict, sizes: dict) -> None:
    assert select_runner(_config(**sizes, **force), HEALTHY_GPU).runner == "v1"


@pytest.mark.parametrize(
    ("changes", "feature"),
    [
        ({"sequence_parallel": True, "tensor_parallel_size": 2}, "sequence parallelism"),
        (
            {"pipeline_parallel_size": 2, "distributed_executor_backend": "external_launcher"},
            "pipeline parallelism with external_launcher",
        ),
    ],
)
def test_the_rules_vllm_sends_to_v1_select_v1_and_forced_v2_runs_them(
    changes: dict, feature: str, warnings_logged: _Warnings
) -> None:
    choice = select_runner(_config(**changes), HEALTHY_GPU)
    assert (choice.runner, choice.rule) == ("v1", "unsupported_features")
    assert f"{feature} select V1" in choice.reason
    assert len(warnings_logged.messages()) == 1
    forced = select_runner(_config(requested_runner="v2", **changes), HEALTHY_GPU)
    assert (forced.runner, forced.rule) == ("v2", "override")
