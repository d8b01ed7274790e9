"""The speculative graphs of a loaded model, captured once and kept with its step graphs.

Two families share the draft tables, the slot buffer and one memory pool:

- the uniform steps' graphs (gpu/spec_decode/uniform_graphs.py): a whole pure-decode
  speculative step, per (padded request count, K, filters);
- the tail graphs (gpu/spec_decode/spec_graphs.py): the tail of a speculative step whose
  forward runs as a mixed step (prefill chunks beside it, or no uniform graph holds it),
  and the proposal a mixed speculative step after plain ones replays first.

The uniform graphs hold a forward each and are captured first (most tokens first), so the
tails reuse their memory in the pool. The memory is taken after the KV cache is sized
(as every speculative graph's is) and logged.
"""

from __future__ import annotations

import weakref

import structlog
import torch

from actors.protocol.config import EngineConfig
from actors.protocol.speculative_config import SpeculativeConfig
from gpu.cuda_graphs import StepGraphs
from gpu.models.llama import DecoderModel
from gpu.runner_v2.step_state import V2StepState
from gpu.spec_decode.spec_graphs import MAX_SPEC_GRAPH_LOGIT_ROWS, SpecTailGraphs
from gpu.spec_decode.uniform_graphs import UniformSpecGraphs

log = structlog.get_logger("tandem.spec_graphs")

_CAPTURED: weakref.WeakKeyDictionary[StepGraphs, dict[SpeculativeConfig, SpecTailGraphs]] = (
    weakref.WeakKeyDictionary()
)


def spec_tail_graphs_for(
    step_graphs: StepGraphs, model: DecoderModel, step_state: V2StepState, config: EngineConfig
) -> SpecTailGraphs | None:
    """The speculative graphs `config` runs with (`spec_tail_graphs`), or None where a
    speculative step runs its tail eagerly: no speculation, `spec_tail_graphs` off, or a
    tensor-parallel model (its ranks sample the batch between them)."""
    spec = config.speculative_config
    if spec is None or not config.spec_tail_graphs or model.tp is not None:
        return None
    return spec_tail_graphs(step_graphs, model, step_state, spec)


def spec_tail_graphs(
    step_graphs: StepGraphs,
    model: torch.nn.Module,
    step_state: V2StepState,
    config: SpeculativeConfig,
) -> SpecTailGraphs:
    """The speculative graphs of a loaded model's step graphs under `config` (the tails,
    with the uniform steps' graphs as their `uniform`), captured by the first runner that
    asks (a model loaded without speculation may serve an engine with it) and kept as long
    as the step graphs: runners come and go, the capture stays."""
    per_config = _CAPTURED.setdefault(step_graphs, {})
    graphs = per_config.get(config)
    if graphs is None:
        graphs = SpecTailGraphs(model, step_state, config, step_graphs.sizes.decode)
        graphs.uniform = UniformSpecGraphs(
            step_graphs,
            step_state,
            graphs.drafts,
            graphs.num_draft_slots_gpu,
            MAX_SPEC_GRAPH_LOGIT_ROWS,
        )
        device = step_state.buffers.device
        free_before = _free_device_bytes(device)
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        with torch.inference_mode():
            graphs.uniform.capture(pool)
        graphs.capture(step_graphs, pool)
        log.info(
            "spec_graphs_captured",
            num_tail_graphs=3 * len(graphs.sizes),
            tail_sizes=",".join(map(str, graphs.sizes)),
            num_uniform_graphs=graphs.uniform.num_captured,
            uniform_sizes=";".join(
                f"K={k}:{','.join(map(str, sizes))}" for k, sizes in graphs.uniform.sizes.items()
            ),
            capture_time_s=round(graphs.capture_time_s + graphs.uniform.capture_time_s, 2),
            memory_gib=round((free_before - _free_device_bytes(device)) / (1 << 30), 3),
        )
        per_config[config] = graphs
    return graphs


def _free_device_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]
