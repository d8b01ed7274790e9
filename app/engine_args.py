"""Engine flags shared by `tandem serve`, `tandem generate` and the benchmarks.

Every flag has a TANDEM_<NAME> environment equivalent (e.g. --max-model-len and
TANDEM_MAX_MODEL_LEN); a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from actors.protocol.config import MXFP4_COPY_CHOICES, QUANTIZATION_CHOICES, EngineConfig
from actors.protocol.logits_processors import parse_logits_processor_specs
from actors.protocol.speculative_config import parse_speculative_config

_DEFAULTS = EngineConfig()


def _env(name: str, default: Any) -> Any:
    return os.environ.get("TANDEM_" + name.upper().replace("-", "_"), default)


def _bool_env(name: str, default: bool) -> bool:
    value = _env(name, None)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    _add_model_args(g)
    _add_cache_args(g)
    _add_scheduling_args(g)
    _add_device_split_args(g)
    _add_runner_feature_args(parser, g)


def _add_model_args(g: Any) -> None:
    """What to load and where: the model, its dtype and precision, the device, the context."""
    g.add_argument(
        "--model",
        default=_env("model", _DEFAULTS.model),
        help="'default' (embedded SmolLM2-135M-Instruct), a .gguf file, a Hugging Face "
        "directory, or dummy:<preset> (random weights: qwen3-0.6b, qwen3-8b, "
        "qwen3-32b, llama-3.1-8b, llama-3.1-70b, smollm2-135m, qwen2-0.5b). "
        "Env: TANDEM_MODEL",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=_env("dtype", _DEFAULTS.dtype),
        help="compute dtype; auto = float32 on CPU, bfloat16 on GPU",
    )
    g.add_argument(
        "--quantization",
        "-q",
        choices=list(QUANTIZATION_CHOICES),
        default=_env("quantization", _DEFAULTS.quantization),
        help="weight quantization. auto (default): what the checkpoint holds: FP8 "
        "checkpoints (quant_method fp8 with 128x128 blocks or per tensor; "
        "compressed-tensors float-quantized, per tensor or per channel) run their "
        "attention and dense MLP projections as FP8 GEMMs on CUDA GPUs of compute "
        "capability >= 8.9 and are dequantized to --dtype on CPU; a GGUF's Q4_0 / Q4_1 "
        "projections (the embedded model's) stay packed int4 on one CPU device (bf16 "
        "activations) and are dequantized elsewhere; other quantization methods are "
        "refused. fp8: quantize an unquantized model's projections (dummy weights "
        "included) per output channel at load, with activations quantized per token "
        "(CUDA >= 8.9 only). int4: every projection packed int4 on the CPU, in groups of "
        "32 columns (Q4 blocks kept, the rest quantized at load; one CPU device only). "
        "none: dequantize every projection to --dtype (what FP8 checkpoints need on "
        "older GPUs). Qwen3-MoE experts stored in FP8 (or quantized by fp8) stay FP8 on "
        "such GPUs, weight-only (--dtype activations). The LM head, embeddings, norms "
        "and MoE routers stay in --dtype (gpt-oss's MXFP4 experts stay MXFP4). "
        "Env: TANDEM_QUANTIZATION",
    )
    g.add_argument(
        "--device", default=_env("device", _DEFAULTS.device), help="auto, cpu, cuda or cuda:N"
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=_env("max_model_len", None),
        help="context length in tokens (default: the model's)",
    )


def _add_cache_args(g: Any) -> None:
    """The KV cache: its blocks, dtype, size and the offload tiers behind it."""
    g.add_argument(
        "--block-size",
        type=int,
        default=int(_env("block_size", _DEFAULTS.block_size)),
        help="tokens per KV cache block",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3"],
        default=_env("kv_cache_dtype", _DEFAULTS.kv_cache_dtype),
        help="KV cache element type: auto = the model dtype; fp8 (= fp8_e4m3) stores "
        "float8 e4m3 with one key and one value scale per layer (1.0, or the checkpoint's "
        "k_scale/v_scale): one byte per element, so the same memory holds twice the KV "
        "tokens of a bf16 cache. Needs a GPU of compute capability 8.9+ (Ada, Hopper) or "
        "the CPU. "
        "Env: TANDEM_KV_CACHE_DTYPE",
    )
    g.add_argument(
        "--mxfp4-copy",
        choices=list(MXFP4_COPY_CHOICES),
        default=_env("mxfp4_copy", _DEFAULTS.mxfp4_copy),
        help="keep MXFP4 experts (gpt-oss) also in bf16 or FP8 on the GPU, for steps with "
        "many tokens per expert (prefill, large decode batches), where these multiply faster "
        "than MXFP4 tiles dequantized in registers (the FP8 copy serves every step and "
        "replaces the MXFP4 experts; with the bf16 copy small steps keep reading MXFP4). The "
        "activations stay bf16 and the products the same (bf16 holds every MXFP4 value; FP8 "
        "with a power-of-two scale per row nearly every one: a count that rounds is logged). "
        "Costs the experts' bytes, taken from the KV cache: gpt-oss-20b 38 GB in bf16, 9 GB "
        "in FP8 (19 GB less the MXFP4 experts it replaces). Env: TANDEM_MXFP4_COPY",
    )
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=_env("num_kv_blocks", None),
        help="fix the number of KV cache blocks instead of sizing from memory",
    )
    g.add_argument(
        "--kv-offload-cpu-gb",
        type=float,
        default=float(_env("kv_offload_cpu_gb", 0)),
        help="host-memory tier of the prefix cache, in GiB (0: off): KV blocks evicted from "
        "the device pool are copied to pinned host memory (pageable, with a warning, "
        "where pinning is unavailable) and copied back on a later prefix hit instead of "
        "being recomputed. Env: TANDEM_KV_OFFLOAD_CPU_GB",
    )
    g.add_argument(
        "--kv-offload-disk-path",
        default=_env("kv_offload_disk_path", None),
        help="directory of a disk tier behind the host tier (needs --kv-offload-cpu-gb): "
        "blocks evicted from host memory are written there in the background, checked "
        "by a checksum when read back (a bad file is a miss). Files left there by an "
        "earlier run are deleted at start. Env: TANDEM_KV_OFFLOAD_DISK_PATH",
    )
    g.add_argument(
        "--kv-offload-disk-gb",
        type=float,
        default=float(_env("kv_offload_disk_gb", 16)),
        help="most GiB the disk tier keeps per engine core; least recently used blocks "
        "are deleted first. Env: TANDEM_KV_OFFLOAD_DISK_GB",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=float(_env("gpu_memory_utilization", _DEFAULTS.gpu_memory_utilization)),
        help="fraction of GPU memory for weights, activations, graphs and KV cache",
    )


def _add_scheduling_args(g: Any) -> None:
    """What a step may hold, and the runner that runs it."""
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=int(_env("max_num_seqs", _DEFAULTS.max_num_seqs)),
        help="most requests in one step",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int(_env("max_num_batched_tokens", _DEFAULTS.max_num_batched_tokens)),
        help="most tokens in one step; longer prompts are prefilled in chunks",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=int(_env("max_logprobs", _DEFAULTS.max_logprobs)),
        help="most logprobs returned per token: the largest 'logprobs' (completions), "
        "'top_logprobs' (chat) and 'prompt_logprobs' a request may ask for; more is a "
        "400 naming the field. Default 20, as vLLM; -1: no cap but the vocabulary "
        "size (a large answer may then take much memory). Env: TANDEM_MAX_LOGPROBS",
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=_bool_env("no_prefix_caching", False),
        help="disable reuse of cached prompt blocks across requests",
    )
    g.add_argument(
        "--no-prefix-caching-outputs",
        action="store_true",
        default=_bool_env("no_prefix_caching_outputs", False),
        help="publish only prompt blocks to the prefix cache, not the blocks that decoding "
        "completes (by default a chat's next turn hits its previous answer; this turns that "
        "off, to measure what it gives). Env: TANDEM_NO_PREFIX_CACHING_OUTPUTS",
    )
    g.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        default=_bool_env("enable_prompt_embeds", False),
        help="accept prompts given as embedding rows: 'prompt_embeds' on /v1/completions, "
        "base64 of a safetensors file holding one [num_tokens, hidden_size] float32/"
        "bfloat16/float16 tensor (or {data, dtype, shape} raw), as vLLM's flag. Pickled "
        "tensors (torch.save) are refused. Env: TANDEM_ENABLE_PROMPT_EMBEDS",
    )
    g.add_argument(
        "--runner",
        choices=["auto", "v1", "v2"],
        default=_env("runner", _DEFAULTS.runner),
        help="model runner; auto applies the startup selection rules "
        "(TANDEM_USE_V2_MODEL_RUNNER=1/0 also forces one)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=_bool_env("enforce_eager", False),
        help="disable CUDA graphs",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=int(_env("seed", _DEFAULTS.seed)),
        help="seed for dummy weights and for requests without a seed",
    )
    g.add_argument(
        "--tokenizer",
        default=_env("tokenizer", None),
        help="a tokenizer.json file or a Hugging Face tokenizer directory to use "
        "instead of the model's own (pairs any weights, dummy ones included, "
        "with a real tokenizer). Env: TANDEM_TOKENIZER",
    )


def _add_device_split_args(g: Any) -> None:
    """How the model is split over devices, and the engine's CPU threads."""
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=int(_env("tensor_parallel_size", _DEFAULTS.tensor_parallel_size)),
        help="split the model over this many GPUs of this host (one worker process "
        "each; attention heads and the MLP width divisible by it)",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=int(_env("pipeline_parallel_size", _DEFAULTS.pipeline_parallel_size)),
        help="split the model's layers into this many consecutive stages, each on its own "
        "--tensor-parallel-size GPUs of this host (one worker process per GPU; run "
        "eagerly). One batch is in flight at a time. Not with structured "
        "outputs, speculative decoding or the KV offload tiers yet. "
        "Env: TANDEM_PIPELINE_PARALLEL_SIZE",
    )
    g.add_argument(
        "--enable-sequence-parallelism",
        action="store_true",
        default=_bool_env("enable_sequence_parallelism", False),
        help="with --tensor-parallel-size above 1: shard the residual stream along tokens "
        "between the ranks of a stage, a reduce-scatter and an all-gather in place of "
        "each all-reduce, so each rank norms and adds its share of the tokens only; the "
        "same tokens as without. Env: TANDEM_ENABLE_SEQUENCE_PARALLELISM",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=_env("cpu_threads", None),
        help="torch intra-op threads of the engine core (of each tensor-parallel rank). "
        "Default: chosen from the CPUs it may use (affinity and cgroup quota): 1 on "
        "1-2 CPUs, otherwise all but one left to the API servers; at most 8 on CUDA. "
        "OMP_NUM_THREADS also sets it. Env: TANDEM_CPU_THREADS",
    )


def _add_runner_feature_args(parser: argparse.ArgumentParser, g: Any) -> None:
    """Features that only the V1 runner has, and what is not implemented at all."""
    g.add_argument(
        "-O",
        "--compile-level",
        type=int,
        choices=(0, 1, 2),
        default=int(_env("compile_level", _DEFAULTS.compile_level)),
        help="torch.compile the model on the V1 runner: 0 eager (default); 1 "
        "inductor, default mode; 2 inductor, max-autotune-no-cudagraphs. "
        "Compiles the token-wise layers (norms, projections, MLP, rotary) "
        "between the eager attention calls, at startup. The V2 runner does "
        "not support it yet: -O1/-O2 select V1 (forcing V2 is an error). "
        "Env: TANDEM_COMPILE_LEVEL",
    )
    g.add_argument(
        "--logits-processors",
        metavar="MODULE:CLASS[,...]",
        default=_env("logits_processors", ""),
        help="custom logits processors (subclasses of "
        "actors.protocol.logits_processors.LogitsProcessor), applied in this "
        "order; requests pass them arguments in 'vllm_xargs'. They run on the "
        "V1 runner: setting any selects V1 (forcing V2 is an error). "
        "Env: TANDEM_LOGITS_PROCESSORS",
    )
    g.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=_env("speculative_config", None),
        help='speculative decoding, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        "\"prompt_lookup_max\": 5}' (vLLM's keys and defaults): ngram "
        "(prompt-lookup) drafting, verified in one forward; greedy and seeded "
        "outputs are those without it. V2 drafts on the device; V1 (chosen "
        "by another flag or rule) on the CPU. "
        "Env: TANDEM_SPECULATIVE_CONFIG",
    )
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--distributed-timeout-seconds",
        type=float,
        default=float(_env("distributed_timeout_seconds", _DEFAULTS.distributed_timeout_s)),
        help="with several ranks: how long a collective waits for a rank before the engine "
        "is declared dead (a hung or lost rank; a rank that exits is noticed at once with "
        "tandem's own launcher). Loading may take longer. Env: "
        "TANDEM_DISTRIBUTED_TIMEOUT_SECONDS",
    )
    parallel.add_argument(
        "--distributed-executor-backend",
        choices=("mp", "external_launcher"),
        default=_env("distributed_executor_backend", "mp"),
        help="who starts the ranks of --tensor-parallel-size x --pipeline-parallel-size: "
        "mp (default: the engine spawns them) or external_launcher (torchrun starts every "
        "rank, each running this same `tandem generate` command; rank 0 prints). With "
        "pipeline parallelism, external_launcher selects the V1 runner (runner-selection "
        "rule 5, as in vLLM 0.29). `tandem serve` takes mp only. "
        "Env: TANDEM_DISTRIBUTED_EXECUTOR_BACKEND",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "device": args.device,
        "max_model_len": None if args.max_model_len is None else int(args.max_model_len),
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_kv_blocks": None if args.num_kv_blocks is None else int(args.num_kv_blocks),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_offload_cpu_bytes": _gib_to_bytes(args.kv_offload_cpu_gb),
        "kv_offload_disk_path": args.kv_offload_disk_path or None,
        "kv_offload_disk_bytes": _gib_to_bytes(args.kv_offload_disk_gb),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_logprobs": args.max_logprobs,
        "enable_prefix_caching": not args.no_prefix_caching,
        "prefix_caching_outputs": not args.no_prefix_caching_outputs,
        "runner": args.runner,
        "enforce_eager": args.enforce_eager,
        "mxfp4_copy": args.mxfp4_copy,
        "seed": args.seed,
        "tokenizer": args.tokenizer or None,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "enable_sequence_parallelism": args.enable_sequence_parallelism,
        "distributed_executor_backend": args.distributed_executor_backend,
        "distributed_timeout_s": args.distributed_timeout_seconds,
        "cpu_threads": None if args.cpu_threads is None else int(args.cpu_threads),
        "enable_prompt_embeds": args.enable_prompt_embeds,
        "compile_level": args.compile_level,
        "logits_processors": parse_logits_processor_specs(args.logits_processors or ""),
        "speculative_config": (
            None
            if args.speculative_config is None
            else parse_speculative_config(args.speculative_config)
        ),
    }
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in values.items() if k in known})


def _gib_to_bytes(num_gib: float) -> int:
    """GiB (a flag's float) -> bytes; a negative size stays negative, for the config's
    one-line refusal."""
    return int(num_gib * (1 << 30))
