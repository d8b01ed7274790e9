"""How many KV cache blocks fit: measured, not guessed.

On CUDA, before the KV cache exists:

1. weights: what the caching allocator holds once the model, the step buffers and the V2
   step state (row tables, sampling parameters, graph outputs) are allocated;
2. activations: the peak of one maximal dummy step (max_num_batched_tokens tokens, logits
   and a sampling-sized copy for max_num_seqs rows), over a one-block dummy KV cache;
3. CUDA graphs: the two largest graphs of each kind captured into a throwaway pool,
   extrapolated to all sizes (see cuda_graphs.measure_graph_memory);
4. non-torch memory: what the device has in use beyond torch's reservations (CUDA context,
   library handles);
5. runner state: what runners allocate later: the penalty tables (allocated once a request
   uses penalties) and a V1 runner's row tables.

KV bytes = gpu_memory_utilization * total - (1..5). Every term is logged. The blocks are
that budget over `kv_bytes_per_block`, which counts the KV cache's own element size: 1 byte
for --kv-cache-dtype fp8, so an fp8 cache gets twice the blocks of a bf16 one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import structlog
import torch

from gpu.attention.base import AttentionMetadata, allocate_kv_cache
from gpu.cuda_graphs import StepGraphs, measure_graph_memory
from gpu.input_buffers import InputBuffers
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.runner_v2.step_plan import GraphSizes
from gpu.runner_v2.step_state import V2StepState

log = structlog.get_logger("tandem.kv_sizing")

GiB = float(1 << 30)
FREE_MEMORY_SLACK_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class MemoryReport:
    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    graph_estimate_bytes: int
    non_torch_bytes: int
    runner_state_bytes: int
    kv_budget_bytes: int

    def as_log(self) -> dict[str, float]:
        return {
            k: (round(v / GiB, 3) if k.endswith("_bytes") else v) for k, v in asdict(self).items()
        }


@dataclass(frozen=True, slots=True)
class StepShape:
    """The limits a maximal step is built from."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int


def kv_bytes_per_block(
    model: ModelConfig,
    num_kv_heads: int,
    block_size: int,
    kv_dtype: torch.dtype,
    num_layers: int | None = None,
) -> int:
    """Bytes of one KV block over every layer (K and V), for a rank holding num_kv_heads
    of the model's KV heads, in the cache's dtype (1 byte an element for float8); over
    `num_layers` layers (a pipeline stage's) instead of the model's when given."""
    element_size = torch.empty((), dtype=kv_dtype).element_size()
    num_layers = model.num_layers if num_layers is None else num_layers
    per_layer_token = 2 * num_kv_heads * model.head_dim * element_size
    return num_layers * per_layer_token * block_size


def runner_state_bytes(model: ModelConfig, shape: StepShape) -> int:
    """Device bytes runners allocate after startup: the penalty tables (prompt mask and
    output counts per row and token) and a V1 runner's sampling rows."""
    penalties = shape.max_num_seqs * model.vocab_size * (1 + 4)  # bool mask + int32 counts
    return penalties + (1 << 20)


@torch.inference_mode()
def profile_kv_budget(
    model: DecoderModel,
    step_state: V2StepState,
    shape: StepShape,
    kv_dtype: torch.dtype,
    gpu_memory_utilization: float,
    graph_sizes: GraphSizes | None,
) -> MemoryReport:
    """Measure every term and return the KV budget (see the module doc). The dummy
    step runs on a one-block cache of kv_dtype, so it measures the kernels serving uses."""
    config = model.config
    buffers = step_state.buffers
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    weights_bytes = torch.cuda.memory_allocated()
    dummy_kv = allocate_kv_cache(
        config.num_layers,
        1,
        shape.block_size,
        config.num_kv_heads,
        config.head_dim,
        kv_dtype,
        buffers.device,
    )
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _maximal_dummy_step(model, buffers, dummy_kv, shape)
    torch.cuda.synchronize()
    activation_peak = torch.cuda.max_memory_allocated() - baseline
    graph_estimate = 0
    if graph_sizes is not None:
        graphs = StepGraphs(
            model, dummy_kv, step_state, graph_sizes, shape.block_size, shape.max_model_len
        )
        graph_estimate, graph_terms = measure_graph_memory(graphs)
        log.info(
            "graph_memory_measured",
            **{
                k: (round(v / GiB, 3) if k.endswith("bytes") else v) for k, v in graph_terms.items()
            },
        )
    del dummy_kv
    torch.cuda.synchronize()
    # The profile's activations go back to the device, as graph capture does.
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    non_torch = max(total_bytes - free_bytes - torch.cuda.memory_reserved(), 0)
    state_bytes = runner_state_bytes(config, shape)
    budget = (
        int(gpu_memory_utilization * total_bytes)
        - weights_bytes
        - activation_peak
        - graph_estimate
        - non_torch
        - state_bytes
    )
    # Memory held elsewhere (another process, another model in this one) is not ours to
    # take: never plan on more than is free now, less what the graphs and runner will need.
    budget = min(
        budget,
        free_bytes - activation_peak - graph_estimate - state_bytes - FREE_MEMORY_SLACK_BYTES,
    )
    report = MemoryReport(
        total_bytes,
        gpu_memory_utilization,
        weights_bytes,
        activation_peak,
        graph_estimate,
        non_torch,
        state_bytes,
        max(budget, 0),
    )
    log.info("kv_cache_budget_gib", **report.as_log())
    return report


def _maximal_dummy_step(
    model: DecoderModel, buffers: InputBuffers, kv_caches: list[torch.Tensor], shape: StepShape
) -> None:
    """max_num_batched_tokens prefill tokens over max_num_seqs requests, then logits and a
    sampling-sized copy for every request. Slots are -1 and every block-table row points at
    block 0, so the one-block dummy cache is never written and reads stay in bounds."""
    num_reqs = min(shape.max_num_seqs, shape.max_num_batched_tokens, buffers.max_num_reqs)
    # No request is longer than max_model_len, so its block-table row covers its keys.
    num_tokens = min(
        shape.max_num_batched_tokens, buffers.max_num_tokens, num_reqs * shape.max_model_len
    )
    query_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
    query_lens[-1] += num_tokens - int(query_lens.sum())
    query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc_np[1:])
    buffers.upload_step_meta(np.arange(num_reqs, dtype=np.int32), query_start_loc_np)
    buffers.input_ids[:num_tokens].zero_()
    buffers.positions[:num_tokens].zero_()
    buffers.slot_mapping[:num_tokens].fill_(-1)
    buffers.block_table[:num_reqs].zero_()
    # Keys past the first block would be read from block 0 again: harmless for a profile.
    buffers.seq_lens[:num_reqs].copy_(torch.from_numpy(query_lens))
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=num_reqs,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(query_lens.max()),
        query_start_loc=buffers.query_start_loc[: num_reqs + 1],
        seq_lens=buffers.seq_lens[:num_reqs],
        slot_mapping=buffers.slot_mapping[:num_tokens],
        block_table=buffers.block_table[:num_reqs],
        query_start_loc_cpu=query_start_loc_np,
        seq_lens_cpu=query_lens,
    )
    hidden = model(
        buffers.input_ids[:num_tokens], buffers.positions[:num_tokens], kv_caches, metadata
    )
    logits = model.compute_logits(hidden[query_start_loc_np[1:] - 1])
    processed = logits.clone()  # the sampler's processing copy
    processed.argmax(dim=-1)
