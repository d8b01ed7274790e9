"""Startup choice between the V2 runner and the V1 fallback.

`select_runner` is a pure function of the resolved config and the probed platform. Rules
in order, first match wins:

1. an explicit request (TANDEM_USE_V2_MODEL_RUNNER or --runner v1/v2) -> that runner;
   forcing V2 where it cannot run, or V1 together with a V2-only feature, is an error;
2. a (device type, architecture) pair listed in V2_UNSUPPORTED_PLATFORM_ARCHITECTURES -> V1;
3. Triton missing or unusable on a GPU -> V1;
4. pinned memory / UVA unavailable on a GPU (e.g. WSL2) -> V1; on CPU, V2 runs on plain
   CPU tensors and needs neither;
5. a feature V2 does not support yet -> V1 (ngram speculative decoding is not one: V2
   drafts on the device; it runs on V1, with a CPU proposer, only where another rule or
   feature selects V1); and the two configurations vLLM 0.29 sends to its V1 runner,
   sequence parallelism and pipeline parallelism under an external launcher (torchrun),
   which V1 serves by default here too, while V2 serves them when forced;
6. otherwise V2.

Every fallback to V1 logs one warning naming the rule. If the env var and --runner both
ask for a runner and disagree, selection fails: both are explicit requests and quietly
preferring one could run the runner the operator did not mean. A fallback to V1 while
V2-only features are requested fails too, rather than silently dropping the feature.
Tensor and pipeline parallelism run on either runner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from gpu.platform import Platform

logger = logging.getLogger(__name__)

RUNNER_ENV_VAR = "TANDEM_USE_V2_MODEL_RUNNER"

V2_UNSUPPORTED_PLATFORM_ARCHITECTURES: frozenset[tuple[str, str]] = frozenset()
"""(device_type, architecture) pairs that default to V1. Forcing V2 still runs V2 there."""

_TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
_FALSE_VALUES = frozenset({"0", "false", "no", "off"})


class RunnerSelectionError(ValueError):
    """The requested runner cannot serve this configuration; the message says why."""


@dataclass(frozen=True, slots=True)
class RunnerSelectionInput:
    architecture: str
    """Model architecture, e.g. 'llama'."""
    env_override: bool | None = None
    """TANDEM_USE_V2_MODEL_RUNNER parsed by parse_runner_env: True = V2, False = V1."""
    requested_runner: Literal["auto", "v1", "v2"] = "auto"
    """--runner; 'v1'/'v2' force a runner like the env var does."""
    compilation_mode: Literal["none", "stock_torch_compile"] = "none"
    sequence_parallel: bool = False
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    speculative_method: str | None = None
    custom_logits_processors: tuple[str, ...] = ()
    v2_only_features: tuple[str, ...] = ()
    """Requested features only the V2 runner implements."""
    tensor_parallel_size: int = 1
    """--tensor-parallel-size; above 1 it is a V2-only feature (V1 runs on one device)."""

    def __post_init__(self) -> None:
        if self.requested_runner not in ("auto", "v1", "v2"):
            raise RunnerSelectionError(
                f"--runner must be auto, v1 or v2, got {self.requested_runner!r}"
            )
        if self.compilation_mode not in ("none", "stock_torch_compile"):
            raise RunnerSelectionError(
                "compilation_mode must be 'none' or 'stock_torch_compile', "
                f"got {self.compilation_mode!r}"
            )
        if self.pipeline_parallel_size < 1:
            raise RunnerSelectionError(
                f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}"
            )
        if self.tensor_parallel_size < 1:
            raise RunnerSelectionError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )

    @property
    def all_v2_only_features(self) -> tuple[str, ...]:
        """The requested features only the V2 runner implements."""
        return self.v2_only_features


@dataclass(frozen=True, slots=True)
class RunnerChoice:
    runner: Literal["v1", "v2"]
    reason: str
    rule: str
    """Which rule decided: override, platform_architecture, triton, pinned_memory,
    unsupported_features or default."""


def parse_runner_env(value: str | None) -> bool | None:
    """TANDEM_USE_V2_MODEL_RUNNER: unset or empty -> None, 1/true/yes/on -> True (V2),
    0/false/no/off -> False (V1); anything else raises RunnerSelectionError."""
    if value is None or not value.strip():
        return None
    normalized = value.strip().lower()
    if normalized in _TRUE_VALUES:
        return True
    if normalized in _FALSE_VALUES:
        return False
    raise RunnerSelectionError(f"{RUNNER_ENV_VAR} must be 1 (V2) or 0 (V1), got {value!r}")


def select_runner(config: RunnerSelectionInput, platform: Platform) -> RunnerChoice:
    """Pick the runner for this config on this platform (see the module doc for the rules)."""
    forced = _forced_runner(config)
    if forced is not None:
        return _forced_choice(forced, config, platform)
    fallback = _first_fallback(config, platform)
    if fallback is None:
        return RunnerChoice("v2", "no fallback rule applies", "default")
    number, rule, reason = fallback
    if config.all_v2_only_features:
        raise RunnerSelectionError(
            f"the requested features {', '.join(config.all_v2_only_features)} need the V2 runner, "
            f"but rule {number} ({rule}) selects V1: {reason}"
        )
    logger.warning("runner selection rule %d (%s): %s; using the V1 runner", number, rule, reason)
    return RunnerChoice("v1", reason, rule)


def _forced_runner(config: RunnerSelectionInput) -> Literal["v1", "v2"] | None:
    from_env = None if config.env_override is None else ("v2" if config.env_override else "v1")
    from_flag = None if config.requested_runner == "auto" else config.requested_runner
    if from_env is not None and from_flag is not None and from_env != from_flag:
        raise RunnerSelectionError(
            f"{RUNNER_ENV_VAR} asks for the {from_env.upper()} runner but --runner asks for "
            f"{from_flag}; remove one of them"
        )
    return from_env or from_flag


def _forced_choice(
    forced: Literal["v1", "v2"], config: RunnerSelectionInput, platform: Platform
) -> RunnerChoice:
    source = RUNNER_ENV_VAR if config.env_override is not None else f"--runner {forced}"
    if forced == "v1":
        if config.all_v2_only_features:
            raise RunnerSelectionError(
                f"{source} forces the V1 runner, which does not support: "
                f"{', '.join(config.all_v2_only_features)}"
            )
        return RunnerChoice("v1", f"forced by {source}", "override")
    blockers = _v2_platform_blockers(platform)
    features = unsupported_v2_features(config, forced=True)
    if features:
        blockers.append(f"the V2 runner does not support {', '.join(features)} yet")
    if blockers:
        raise RunnerSelectionError(
            f"{source} forces the V2 runner, which cannot run here: {'; '.join(blockers)}"
        )
    return RunnerChoice("v2", f"forced by {source}", "override")


def _first_fallback(
    config: RunnerSelectionInput, platform: Platform
) -> tuple[int, str, str] | None:
    if (platform.device_type, config.architecture) in V2_UNSUPPORTED_PLATFORM_ARCHITECTURES:
        return (
            2,
            "platform_architecture",
            (
                f"the V2 runner is not supported for architecture {config.architecture!r} "
                f"on {platform.device_type}"
            ),
        )
    if platform.is_cuda and not platform.has_triton:
        return 3, "triton", "the V2 runner needs Triton, which is missing or unusable on this GPU"
    if platform.is_cuda and not (platform.pin_memory_available and platform.uva_available):
        return 4, "pinned_memory", _pinned_memory_reason(platform)
    features = unsupported_v2_features(config)
    if features:
        missing = unsupported_v2_features(config, forced=True)
        preferred = [f for f in features if f not in missing]
        reasons = [f"the V2 runner does not support {', '.join(missing)} yet"] if missing else []
        if preferred:
            reasons.append(
                f"{', '.join(preferred)} select V1 (as in vLLM 0.29; --runner v2 runs them on V2)"
            )
        return 5, "unsupported_features", "; ".join(reasons)
    return None


def _v2_platform_blockers(platform: Platform) -> list[str]:
    if not platform.is_cuda:
        return []
    blockers = []
    if not platform.has_triton:
        blockers.append("Triton is missing or unusable on this GPU")
    if not (platform.pin_memory_available and platform.uva_available):
        blockers.append(_pinned_memory_reason(platform))
    return blockers


def _pinned_memory_reason(platform: Platform) -> str:
    missing = (
        "pinned host memory" if not platform.pin_memory_available else "UVA access to pinned memory"
    )
    where = " (WSL2)" if platform.is_wsl else ""
    return f"{missing} is unavailable{where}, and the V2 runner needs it on a GPU"


def unsupported_v2_features(config: RunnerSelectionInput, forced: bool = False) -> list[str]:
    """Requested features that send the selection to V1 (rule 5), as readable names;
    `forced`: only those V2 cannot run even when asked for."""
    features = []
    if config.compilation_mode == "stock_torch_compile":
        features.append("stock torch.compile")
    if config.sequence_parallel and not forced:
        features.append("sequence parallelism")
    if (
        config.pipeline_parallel_size > 1
        and config.distributed_executor_backend == "external_launcher"
        and not forced
    ):
        features.append("pipeline parallelism with external_launcher")
    if config.custom_logits_processors:
        features.append(f"custom logits processors ({', '.join(config.custom_logits_processors)})")
    return features
