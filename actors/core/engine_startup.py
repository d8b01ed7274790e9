"""The engine core's startup: probe the platform, pick the runner, load the model."""

from __future__ import annotations

import os
from dataclasses import dataclass

import structlog
import torch

from actors.protocol.config import ConfigError, EngineConfig
from actors.protocol.logits_processors import load_logits_processor_classes
from gpu.cpu_threads import apply_cpu_threads, engine_thread_plan, log_cpu_threads
from gpu.distributed.dp_placement import place_data_parallel_rank
from gpu.distributed.external_launcher import load_external_worker
from gpu.distributed.tp_config import TensorParallelError, validate_tensor_parallel
from gpu.distributed.tp_engine import load_tp_worker
from gpu.models.config import ModelConfig
from gpu.models.precision import WeightPrecision, resolve_precision
from gpu.platform import Platform, probe_platform
from gpu.runner_selection import RunnerChoice, RunnerSelectionInput, parse_runner_env, select_runner
from gpu.runner_v1.compiled_model import check_compilable
from gpu.weights.shard_loader import read_int4_checkpoint, read_model_config
from gpu.worker import ModelWorker, check_kv_cache_dtype, resolve_dtype

log = structlog.get_logger("tandem.startup")

RUNNER_ENV = "TANDEM_USE_V2_MODEL_RUNNER"


@dataclass(frozen=True, slots=True)
class LoadedEngine:
    config: EngineConfig
    platform: Platform
    runner: RunnerChoice
    worker: ModelWorker


def selection_input(config: EngineConfig, architecture: str) -> RunnerSelectionInput:
    return RunnerSelectionInput(
        architecture=architecture,
        env_override=parse_runner_env(os.environ.get(RUNNER_ENV)),
        requested_runner=config.runner,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        sequence_parallel=config.enable_sequence_parallelism,
        distributed_executor_backend=config.distributed_executor_backend,
        compilation_mode="stock_torch_compile" if config.compile_level > 0 else "none",
        custom_logits_processors=config.logits_processors,
        speculative_method=(
            None if config.speculative_config is None else config.speculative_config.method
        ),
    )


def choose_runner(config: EngineConfig, platform: Platform, model: ModelConfig) -> RunnerChoice:
    choice = select_runner(selection_input(config, model.architecture), platform)
    log.info("runner_selected", runner=choice.runner, rule=choice.rule, reason=choice.reason)
    return choice


def check_before_load(config: EngineConfig, platform: Platform) -> None:
    """Refuse what cannot be served before spending the model load on it: processors that
    do not import, a forced runner that cannot run them (the
    forced path of the selection does not depend on the architecture), a --compile-level
    for a model whose parts (FP8 or packed int4 projections among them) the compiled
    pieces leave out,
    --kv-cache-dtype fp8 on a GPU below compute capability 8.9.
    (A precision the device cannot run is refused by the loader before it reads weights.)"""
    load_logits_processor_classes(config.logits_processors)
    check_kv_cache_dtype(config.kv_cache_dtype, platform)
    forced = selection_input(config, architecture="")
    if forced.env_override is not None or forced.requested_runner != "auto":
        select_runner(forced, platform)
    if config.compile_level > 0:
        precision = check_precision(config, platform)
        check_compilable(
            read_model_config(config.model),
            config.compile_level,
            precision.runs_fp8,
            precision.runs_int4,
        )


def check_precision(config: EngineConfig, platform: Platform) -> WeightPrecision:
    """What each projection will run in (gpu/models/precision.py), from the model's config
    (and a GGUF's tensor types) alone; raises UnsupportedModelError for FP8 or int4 the
    device cannot run."""
    device = torch.device(platform.device)
    return resolve_precision(
        read_model_config(config.model),
        config.quantization,
        resolve_dtype(config.dtype, device),
        platform.device_type,
        platform.compute_capability,
        platform.has_triton,
        tp_size=config.tensor_parallel_size,
        int4_checkpoint=read_int4_checkpoint(config.model),
    )


def load_engine(config: EngineConfig, *, frontends_share_host: bool = False) -> LoadedEngine:
    """Everything slow that happens once per process, before the engine's actors start.

    `frontends_share_host`: API-server processes run beside this one (the server's engine
    core), which leaves them a CPU when torch's threads are chosen."""
    config = place_data_parallel_rank(config)  # core i of --data-parallel-size N: cuda:i
    platform = probe_platform(config.device)
    threads = engine_thread_plan(config, platform.device_type, frontends_share_host)
    apply_cpu_threads(threads)
    check_before_load(config, platform)
    if config.num_ranks == 1:
        worker = ModelWorker(config, platform)
    elif config.distributed_executor_backend == "external_launcher":
        check_tensor_parallel(config, platform)
        worker = load_external_worker(config, platform)
    else:
        check_tensor_parallel(config, platform)
        worker = load_tp_worker(config, platform)
    log_cpu_threads(threads)
    try:
        runner = choose_runner(config, platform, worker.model_config)
    except BaseException:
        worker.close()
        raise
    return LoadedEngine(config=config, platform=platform, runner=runner, worker=worker)


def check_tensor_parallel(config: EngineConfig, platform: Platform) -> None:
    """Validate --tensor-parallel-size or --pipeline-parallel-size > 1 (runner, model,
    devices) without loading weights: V1 runs on one device, so a selection that lands on
    V1 is refused here."""
    model = read_model_config(config.model)
    validate_tensor_parallel(
        config.tensor_parallel_size,
        model,
        platform.device_type,
        config.device,
        pp_size=config.pipeline_parallel_size,
    )
    check_precision(config, platform)  # before the ranks start: FP8 block slices, devices
    choice = select_runner(selection_input(config, model.architecture), platform)
    if choice.runner == "v1":
        check_v1_ranks(config)


def check_v1_ranks(config: EngineConfig) -> None:
    """Refuse what the V1 runner does not do over several ranks: its compiled layers hold
    no collectives, and its logits processors and CPU drafter were never run per rank."""
    refused = [
        name
        for name, asked in (
            ("--compile-level", config.compile_level > 0),
            ("--logits-processors", bool(config.logits_processors)),
            ("--speculative-config", config.speculative_config is not None),
        )
        if asked
    ]
    if refused:
        raise ConfigError(
            f"{', '.join(refused)} with the V1 runner over several ranks "
            "(--tensor-parallel-size or --pipeline-parallel-size > 1) is not supported yet"
        )


def reuse_engine(loaded: LoadedEngine, config: EngineConfig) -> LoadedEngine:
    """The same loaded model under other engine options (tests, benchmarks)."""
    if (config.model, config.block_size, config.quantization) != (
        loaded.config.model,
        loaded.config.block_size,
        loaded.config.quantization,
    ):
        raise ValueError("a reused model must keep the same model, block size and quantization")
    if config.kv_cache_dtype != loaded.config.kv_cache_dtype:  # the worker owns the cache
        raise ValueError("a reused model must keep its KV cache dtype")
    check_before_load(config, loaded.platform)
    runner = choose_runner(config, loaded.platform, loaded.worker.model_config)
    return LoadedEngine(
        config=config, platform=loaded.platform, runner=runner, worker=loaded.worker
    )


def load_errors() -> tuple[type[BaseException], ...]:
    """Errors of a start that the configuration caused (files, flags), not a bug."""
    from actors.protocol.logits_processors import LogitsProcessorLoadError
    from actors.protocol.model_source import ModelLoadError
    from actors.protocol.sampling_params import SamplingParamsError
    from actors.protocol.speculative_config import SpeculativeConfigError
    from gpu.models.config import UnsupportedModelError
    from gpu.runner_selection import RunnerSelectionError
    from gpu.worker import WorkerConfigError

    return (
        SamplingParamsError,
        ConfigError,
        UnsupportedModelError,
        RunnerSelectionError,
        ModelLoadError,
        WorkerConfigError,
        TensorParallelError,
        SpeculativeConfigError,
        LogitsProcessorLoadError,
    )
