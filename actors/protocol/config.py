"""Engine configuration: one frozen dataclass, filled from CLI flags or the Python API."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from actors.protocol.speculative_config import SpeculativeConfig

RunnerChoice = Literal["auto", "v1", "v2"]
DTypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
QuantizationChoice = Literal["auto", "fp8", "int4", "none"]
QUANTIZATION_CHOICES = ("auto", "fp8", "int4", "none")
KVCacheDTypeChoice = Literal["auto", "fp8", "fp8_e4m3"]
MXFP4CopyChoice = Literal["none", "bf16", "fp8"]
MXFP4_COPY_CHOICES = ("none", "bf16", "fp8")
DEFAULT_MAX_LOGPROBS = 20
"""vLLM's default --max-logprobs."""


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "default"
    """'default' (the embedded SmolLM2-135M-Instruct), a GGUF file, a Hugging Face
    directory, or 'dummy:<preset>' for random weights of a preset architecture."""
    dtype: DTypeChoice = "auto"
    """Compute dtype; auto is float32 on CPU and bfloat16 on GPU."""
    quantization: QuantizationChoice = "auto"
    """Weight quantization (vLLM's --quantization): auto runs what the checkpoint holds
    (FP8 checkpoints as FP8 GEMMs on CUDA >= 8.9, dequantized on CPU; a GGUF's Q4_0 / Q4_1
    projections packed as int4 on one CPU device, dequantized elsewhere); fp8 quantizes an
    unquantized checkpoint's projections per output channel at load; int4 runs every
    projection as packed int4 on the CPU; none dequantizes everything to `dtype`
    (gpu/models/precision.py decides, per projection)."""
    device: str = "auto"
    """'auto' (CUDA when available), 'cpu' or 'cuda[:N]'."""
    max_model_len: int | None = None
    """Context length; None takes the model's (capped at 8192 for dummy weights)."""
    block_size: int = 16
    """Tokens per KV cache block."""
    num_kv_blocks: int | None = None
    """Fix the KV pool size; None sizes it from memory."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory tandem may use (weights, activations, graphs, KV)."""
    cpu_kv_cache_bytes: int = 1 << 30
    """KV pool size on CPU when num_kv_blocks is not set."""
    kv_cache_dtype: KVCacheDTypeChoice = "auto"
    """KV cache element type (vLLM's --kv-cache-dtype): auto = the model dtype; fp8 (=
    fp8_e4m3) = float8_e4m3fn with a per-layer k_scale / v_scale (1.0 unless the checkpoint
    has them), half of bf16's bytes per token (gpu/attention/kv_cache_dtype.py)."""
    mxfp4_copy: MXFP4CopyChoice = "none"
    """Keep MXFP4 experts also in bf16 or FP8 for steps with many rows per expert
    (--mxfp4-copy; gpu/models/mxfp4_copy.py); refused for a model without MXFP4 experts on
    the device."""
    max_num_seqs: int = 256
    """Most requests in one step (also the runner's row count)."""
    max_num_batched_tokens: int = 2048
    """Most tokens in one step; longer prompts are prefilled in chunks."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Most logprobs a request may ask for per token, in `logprobs` / `top_logprobs` and in
    `prompt_logprobs` (vLLM's --max-logprobs); -1: up to the vocabulary size. Checked by the
    front end (actors/frontend/generation_defaults.py), which the engine core trusts."""
    enable_prefix_caching: bool = True
    prefix_caching_outputs: bool = True
    """Blocks completed by decoding join the prefix cache too, so a chat's next turn hits its
    previous answer; False (--no-prefix-caching-outputs) publishes prompt blocks only, as
    the cache did before, to measure what the answers' reuse gives."""
    kv_offload_cpu_bytes: int = 0
    """Host-memory tier of the prefix cache (--kv-offload-cpu-gb): blocks evicted from the
    device pool are copied to this much (pinned where possible) host memory and copied
    back on a later prefix hit; 0 turns it off."""
    kv_offload_disk_path: str | None = None
    """Disk tier behind the host tier (--kv-offload-disk-path): blocks evicted from host
    memory are written under this directory; None turns it off."""
    kv_offload_disk_bytes: int = 16 << 30
    """Most bytes the disk tier keeps (--kv-offload-disk-gb); least recently used first out."""
    runner: RunnerChoice = "auto"
    """Model runner; auto applies the startup selection rules."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    seed: int = 0
    """Seed for dummy weights and for requests that set no seed."""
    tokenizer: str | None = None
    """Tokenizer source when it differs from the model."""
    tensor_parallel_size: int = 1
    """Devices (one worker process each) that each pipeline stage's layers are split over."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (--pipeline-parallel-size): the layers split into this many
    consecutive groups, each on its own tensor_parallel_size devices."""
    enable_sequence_parallelism: bool = False
    """Under tensor parallelism, shard the residual stream along tokens between the ranks
    of a stage: reduce-scatter and all-gather around the norms instead of all-reduces
    (--enable-sequence-parallelism)."""
    distributed_timeout_s: float = 120.0
    """How long a collective of a multi-rank engine waits for a peer before the engine is
    declared dead (--distributed-timeout-seconds): the bound on a hung rank."""
    distributed_executor_backend: str = "mp"
    """Who starts the ranks of a multi-rank engine: 'mp' (the engine spawns them) or
    'external_launcher' (torchrun starts every rank, each running the same program)."""
    compile_level: int = 0
    """torch.compile of the V1 runner's model (gpu/runner_v1/compiled_model.py): 0 eager,
    1 inductor's default mode, 2 max-autotune-no-cudagraphs. Above 0 it selects V1."""
    logits_processors: tuple[str, ...] = ()
    """Custom logits processors, 'module:Class' each (actors/protocol/logits_processors.py);
    they run on the V1 runner, so any selects V1."""
    speculative_config: SpeculativeConfig | None = None
    """--speculative-config (actors/protocol/speculative_config.py): ngram speculative decoding, on
    either runner (actors/core/spec_scheduling.py, gpu/spec_decode/)."""
    spec_tail_graphs: bool = True
    """With speculation on V2 and CUDA graphs: replay the speculative step's head,
    sampling, acceptance and drafting as CUDA graphs (gpu/spec_decode/spec_graphs.py),
    and pure-decode speculative steps whole as uniform graphs (gpu/spec_decode/
    uniform_graphs.py); False launches them eagerly (the Python API's switch for
    measuring the difference)."""
    cpu_threads: int | None = None
    """torch intra-op threads of the engine (of each tensor-parallel rank); None chooses
    them from the CPUs the engine may use (gpu/cpu_threads.py)."""
    data_parallel_size: int = 1
    """Engine cores `tandem serve` runs, each a whole copy of the model behind the same API
    servers (--data-parallel-size); they share the host's CPU threads."""
    data_parallel_rank: int = 0
    """Which of those cores this is (set by the launcher for each): on CUDA core i runs on
    cuda:i (gpu/distributed/dp_placement.py)."""
    enable_prompt_embeds: bool = False
    """Take prompts given as embedding rows (vLLM's --enable-prompt-embeds): the
    completions API's `prompt_embeds`, `{"prompt_embeds": tensor}` prompts of LLM.generate."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be at least 1")
        if (
            isinstance(self.max_logprobs, bool)
            or not isinstance(self.max_logprobs, int)
            or self.max_logprobs < -1
        ):
            raise ConfigError(f"max_logprobs must be -1 or >= 0, got {self.max_logprobs!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.runner not in ("auto", "v1", "v2"):
            raise ConfigError(f"runner must be auto, v1 or v2, got {self.runner!r}")
        _check_parallelism(self)
        if self.compile_level not in (0, 1, 2):
            raise ConfigError(f"compile_level must be 0, 1 or 2, got {self.compile_level!r}")
        if isinstance(self.logits_processors, str):
            raise ConfigError("logits_processors must be a tuple of 'module:Class' strings")
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        if self.cpu_threads is not None and (
            isinstance(self.cpu_threads, bool)
            or not isinstance(self.cpu_threads, int)
            or self.cpu_threads < 1
        ):
            raise ConfigError(f"cpu_threads must be an integer >= 1, got {self.cpu_threads!r}")
        if self.enable_prompt_embeds and self.compile_level != 0:
            raise ConfigError(
                "enable_prompt_embeds does not work with compile_level > 0 (the compiled "
                "model reads token ids only)"
            )
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ConfigError(
                f"quantization must be auto, fp8, int4 or none, got {self.quantization!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        _check_kv_offload(self)
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ConfigError(
                f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {self.kv_cache_dtype!r}"
            )
        if self.mxfp4_copy not in MXFP4_COPY_CHOICES:
            raise ConfigError(f"mxfp4_copy must be none, bf16 or fp8, got {self.mxfp4_copy!r}")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def num_ranks(self) -> int:
        """Worker ranks of one engine core: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def _check_parallelism(config: EngineConfig) -> None:
    """The ranks of a core (tensor x pipeline), sequence parallelism, who starts the ranks,
    their collectives' timeout, and the data-parallel cores."""
    if not isinstance(config.tensor_parallel_size, int) or config.tensor_parallel_size < 1:
        raise ConfigError(
            f"tensor_parallel_size must be an integer >= 1, got {config.tensor_parallel_size!r}"
        )
    if not isinstance(config.pipeline_parallel_size, int) or config.pipeline_parallel_size < 1:
        raise ConfigError(
            f"pipeline_parallel_size must be an integer >= 1, got {config.pipeline_parallel_size!r}"
        )
    if config.pipeline_parallel_size > 1 and config.speculative_config is not None:
        raise ConfigError("speculative decoding does not run with --pipeline-parallel-size > 1 yet")
    if config.enable_sequence_parallelism and config.tensor_parallel_size == 1:
        raise ConfigError("enable_sequence_parallelism needs tensor_parallel_size > 1")
    if config.enable_sequence_parallelism and config.compile_level != 0:
        raise ConfigError(
            "enable_sequence_parallelism does not work with compile_level > 0 (the "
            "compiled layers all-reduce)"
        )
    if not config.distributed_timeout_s > 0:
        raise ConfigError(
            f"distributed_timeout_s must be positive, got {config.distributed_timeout_s!r}"
        )
    if config.distributed_executor_backend not in ("mp", "external_launcher"):
        raise ConfigError(
            "distributed_executor_backend must be mp or external_launcher, "
            f"got {config.distributed_executor_backend!r}"
        )
    if not isinstance(config.data_parallel_size, int) or config.data_parallel_size < 1:
        raise ConfigError(
            f"data_parallel_size must be an integer >= 1, got {config.data_parallel_size!r}"
        )
    if not 0 <= config.data_parallel_rank < config.data_parallel_size:
        raise ConfigError(
            f"data_parallel_rank must be in [0, {config.data_parallel_size}), "
            f"got {config.data_parallel_rank!r}"
        )


def _check_kv_offload(config: EngineConfig) -> None:
    if config.kv_offload_cpu_bytes < 0:
        raise ConfigError(f"kv_offload_cpu_bytes must be >= 0, got {config.kv_offload_cpu_bytes}")
    if config.kv_offload_disk_bytes < 0:
        raise ConfigError(f"kv_offload_disk_bytes must be >= 0, got {config.kv_offload_disk_bytes}")
    if config.kv_offload_disk_path is not None and config.kv_offload_cpu_bytes == 0:
        raise ConfigError("the KV disk tier (--kv-offload-disk-path) needs --kv-offload-cpu-gb > 0")
    if config.kv_offload_cpu_bytes and not config.enable_prefix_caching:
        raise ConfigError("--kv-offload-cpu-gb needs prefix caching (drop --no-prefix-caching)")
    if config.kv_offload_cpu_bytes and config.num_ranks > 1:
        raise ConfigError(
            "--kv-offload-cpu-gb does not run with --tensor-parallel-size or "
            "--pipeline-parallel-size > 1 yet"
        )
