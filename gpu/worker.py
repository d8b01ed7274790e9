"""What both runners share: the loaded model, its KV cache, the V2 step buffers and state
and the CUDA graphs of the V2 step that replay on them, and the device they live on.

Startup on CUDA: load the weights, measure the memory of a maximal step and of the graphs
(gpu/kv_sizing.py), give the KV cache what is left of --gpu-memory-utilization, then
capture the step graphs (gpu/cuda_graphs.py; --enforce-eager skips them)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from actors.protocol.config import EngineConfig
from actors.protocol.model_source import resolve_model_path
from gpu.attention.base import AttentionBackend, allocate_kv_cache
from gpu.attention.kv_cache_dtype import (
    kv_cache_dtype_name,
    kv_cache_dtype_refusal,
    resolve_kv_cache_dtype,
)
from gpu.cuda_graphs import StepGraphs, capture_sizes, mixed_capture_sizes
from gpu.distributed.group import TPGroup, min_over_ranks
from gpu.distributed.tp_model import load_tp_model
from gpu.input_buffers import InputBuffers
from gpu.kv_sizing import MemoryReport, StepShape, kv_bytes_per_block, profile_kv_budget
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.models.mxfp4_copy import add_mxfp4_copies, mxfp4_copy_bytes, mxfp4_copy_description
from gpu.platform import Platform
from gpu.runner_v2.step_plan import GraphSizes
from gpu.runner_v2.step_state import V2StepState
from gpu.spec_decode.spec_capture import spec_tail_graphs_for
from gpu.weights.loader import load_model_files

log = structlog.get_logger("tandem.worker")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DUMMY_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


class WorkerConfigError(ValueError):
    """The model and the configuration do not fit together (context length, KV memory)."""


class ModelWorker:
    """Loads the model once; runners borrow it (and its KV cache) for their whole life.

    With `tp_group` it is one rank of a TP x PP engine: it loads its shard of its stage's
    weights, and the KV cache (its stage's layers) takes as many blocks as the rank with
    the least memory can hold."""

    def __init__(
        self, config: EngineConfig, platform: Platform, tp_group: TPGroup | None = None
    ) -> None:
        self.config = config
        self.platform = platform
        self.tp_group = tp_group
        self.tp_leader = None
        """Rank 0's handle on the other ranks (gpu/distributed/tp_leader.py), when TP > 1."""
        self.device = (
            tp_group.device
            if tp_group is not None
            else torch.device(_resolve_device(config.device, platform))
        )
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        check_kv_cache_dtype(config.kv_cache_dtype, platform)
        started = time.perf_counter()
        self.attn_backend = _make_attention_backend(self.device, platform)
        self.model, self.model_source = self._load_model()
        self.model_config: ModelConfig = self.model.config
        self.weights_precision = self.model.precision.describe(self.model_config)
        """What runs in what precision, one line (reported in /version)."""
        if config.mxfp4_copy != "none":
            self._add_mxfp4_copies(config.mxfp4_copy)
            self.weights_precision += "; " + mxfp4_copy_description(config.mxfp4_copy)
        for note in self.model.precision.notes:
            log.warning("fp8_weights_dequantized", reason=note)
        self.max_model_len = _resolve_max_model_len(config, self.model_config, self.model_source)
        self.load_time_s = time.perf_counter() - started
        self.buffers = InputBuffers(
            config.max_num_seqs, config.max_num_batched_tokens, self.max_blocks_per_req, self.device
        )
        graph_sizes = self._graph_sizes()
        self.step_state = V2StepState(
            self.buffers,
            self.max_model_len,
            self.max_blocks_per_req,
            self.model_config.vocab_size,
            self.model_config.hidden_size,
            self.dtype,
            with_graph_outputs=graph_sizes is not None,
        )
        self.memory_report: MemoryReport | None = None
        self.kv_spec = self._size_kv_cache(graph_sizes)
        self.kv_caches = allocate_kv_cache(
            len(self.model.layers),
            self.kv_spec.num_blocks,
            config.block_size,
            self.model.num_kv_heads,
            self.model_config.head_dim,
            self.kv_cache_dtype,
            self.device,
        )
        self._log_loaded()
        self.graph_memory_bytes = 0
        self.graphs: StepGraphs | None = self._capture_graphs(graph_sizes)
        self.ready_time_s = time.perf_counter() - started

    def _load_model(self) -> tuple[DecoderModel, str]:
        """The model with its weights on self.device (this rank's shard under TP/PP), and
        where they came from."""
        config = self.config
        if self.tp_group is not None:
            model = load_tp_model(
                config.model,
                self.dtype,
                self.tp_group,
                self.attn_backend,
                config.quantization,
                sequence_parallel=config.enable_sequence_parallelism,
            )
            return model, resolve_model_path(config.model)
        files = load_model_files(
            config.model, self.dtype, self.device, quantization=config.quantization
        )
        model = DecoderModel(
            files.config, self.attn_backend, self.dtype, self.device, precision=files.precision
        )
        # consume: each tensor is freed once copied, so loading peaks near one copy
        model.load_weights(files.weights, consume=True)
        return model, files.source

    def _add_mxfp4_copies(self, kind: str) -> None:
        """--mxfp4-copy, before the KV cache is sized (the copies' bytes are not KV's)."""
        needed = mxfp4_copy_bytes(self.model, kind)
        if needed == 0:
            raise WorkerConfigError(
                f"--mxfp4-copy {kind}: {self.model_source} keeps no MXFP4 experts on "
                f"{self.device} (only gpt-oss checkpoints on a GPU do)"
            )
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            if needed > free:
                raise WorkerConfigError(
                    f"--mxfp4-copy {kind} needs {needed / 2**30:.1f} GiB for the experts' "
                    f"copy, but {free / 2**30:.1f} GiB of {self.device} are free; drop the flag"
                )
        report = add_mxfp4_copies(self.model, kind)
        log.info("mxfp4_copy", kind=kind, bytes=report.num_bytes, rounded=report.num_rounded)

    def _log_loaded(self) -> None:
        log.info(
            "model_loaded",
            source=self.model_source,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            load_time_s=round(self.load_time_s, 3),
            max_model_len=self.max_model_len,
            weights=self.weights_precision,
            kv_cache_dtype=kv_cache_dtype_name(self.kv_cache_dtype),
            kv_blocks=self.kv_spec.num_blocks,
            kv_tokens=self.kv_spec.num_tokens,
            kv_bytes=self.kv_spec.num_bytes,
        )

    @property
    def max_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.config.block_size)

    def _graph_sizes(self) -> GraphSizes | None:
        # The graphs bake the step's metadata in; only the Triton backend reads every length
        # from the device buffers at replay (the torch backend reads host copies).
        if self.device.type != "cuda" or self.config.enforce_eager or not self.platform.has_triton:
            return None
        if self.tp_group is not None and self.tp_group.pp_size > 1:
            return None  # pipeline stages run eagerly (their sends are not captured)
        config = self.config
        return GraphSizes(
            capture_sizes(config.max_num_seqs, config.max_num_batched_tokens),
            mixed_capture_sizes(config.max_num_seqs, config.max_num_batched_tokens),
            config.max_num_seqs,
        )

    def _step_shape(self) -> StepShape:
        return StepShape(
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_model_len,
            self.config.block_size,
        )

    def _size_kv_cache(self, graph_sizes: GraphSizes | None) -> KVCacheSpec:
        # A rank holds its shard of the KV heads (self.model.num_kv_heads).
        bytes_per_block = kv_bytes_per_block(
            self.model_config,
            self.model.num_kv_heads,
            self.config.block_size,
            self.kv_cache_dtype,
            num_layers=len(self.model.layers),  # a pipeline stage's layers
        )
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            self.memory_report = profile_kv_budget(
                self.model,
                self.step_state,
                self._step_shape(),
                self.kv_cache_dtype,
                self.config.gpu_memory_utilization,
                graph_sizes,
            )
            num_blocks = self.memory_report.kv_budget_bytes // bytes_per_block
        else:
            num_blocks = self.config.cpu_kv_cache_bytes // bytes_per_block
        if self.tp_group is not None:  # every rank (and stage) holds the same blocks
            num_blocks = min_over_ranks(num_blocks, self.tp_group)
        # One maximal request must fit, or every long prompt would be preempted forever.
        if num_blocks < self.max_blocks_per_req:
            raise WorkerConfigError(
                f"KV cache holds {num_blocks} blocks of {self.config.block_size} tokens, fewer "
                f"than one request of max_model_len {self.max_model_len} needs "
                f"({self.max_blocks_per_req}); lower --max-model-len or give the cache more memory"
            )
        return KVCacheSpec(num_blocks, self.config.block_size, bytes_per_block)

    def _capture_graphs(self, graph_sizes: GraphSizes | None) -> StepGraphs | None:
        if graph_sizes is None:
            return None
        graphs = StepGraphs(
            self.model,
            self.kv_caches,
            self.step_state,
            graph_sizes,
            self.config.block_size,
            self.max_model_len,
        )
        # Capture empties the allocator's cache; empty it on both sides of the measurement.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        capture_time_s = graphs.capture()
        torch.cuda.empty_cache()
        used_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.graph_memory_bytes = used_bytes
        estimate = self.memory_report.graph_estimate_bytes if self.memory_report else None
        log.info(
            "cuda_graphs_captured",
            num_graphs=graphs.num_captured,
            decode_sizes=f"{graph_sizes.decode[0]}..{graph_sizes.decode[-1]}",
            mixed_sizes=",".join(map(str, graph_sizes.mixed)),
            capture_time_s=round(capture_time_s, 2),
            memory_gib=round(used_bytes / (1 << 30), 3),
            estimate_gib=None if estimate is None else round(estimate / (1 << 30), 3),
        )
        # Captured now, while nothing else runs on the device (a runner captures them on
        # its first use otherwise: a model reused under speculation).
        spec_tail_graphs_for(graphs, self.model, self.step_state, self.config)
        return graphs

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0 only; nothing to do without TP).
        Safe to call more than once."""
        if self.tp_leader is not None:
            self.tp_leader.close()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def check_kv_cache_dtype(choice: str, platform: Platform) -> None:
    """Refuse --kv-cache-dtype fp8 on a GPU whose Triton cannot read float8 e4m3, before
    any weight is read (on CPU the torch path serves it)."""
    reason = kv_cache_dtype_refusal(
        choice, platform.device_type, platform.compute_capability, platform.device_name
    )
    if reason is not None:
        raise WorkerConfigError(reason)


def _resolve_device(name: str, platform: Platform) -> str:
    if name == "auto":
        return "cuda" if platform.device_type == "cuda" else "cpu"
    return name


def _resolve_max_model_len(config: EngineConfig, model: ModelConfig, source: str) -> int:
    model_max = model.max_position_embeddings
    if source.startswith("dummy:"):
        model_max = min(model_max, _DUMMY_MAX_MODEL_LEN)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model.max_position_embeddings:
        raise WorkerConfigError(
            f"max_model_len {config.max_model_len} exceeds the model's context "
            f"length {model.max_position_embeddings}"
        )
    return config.max_model_len


def _make_attention_backend(device: torch.device, platform: Platform) -> AttentionBackend:
    if device.type == "cuda" and platform.has_triton:
        from gpu.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from gpu.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
