"""The floor a qwen3-0.6b decode step is measured against (the same model as
../shared/tools/step_floor.py): stock torch kernels, dense per-request KV (no paging), SDPA
attention, cuBLAS GEMMs, the whole step in one CUDA graph, random bf16 weights. Imports no
tandem code."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, FFN, VOCAB = 1024, 28, 16, 8, 128, 3072, 151936
WEIGHT_BYTES = 1.192e9
KV_BYTES_PER_TOKEN = 114688
PEAK_BYTES_PER_S = 4.26e12


def _weights(device: str, dtype: torch.dtype) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    torch.manual_seed(0)
    layers = [dict(qkv=torch.randn(HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=device, dtype=dtype) * 0.02,
                   o=torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN, device=device, dtype=dtype) * 0.02,
                   gu=torch.randn(HIDDEN, 2 * FFN, device=device, dtype=dtype) * 0.02,
                   d=torch.randn(FFN, HIDDEN, device=device, dtype=dtype) * 0.02)
              for _ in range(NUM_LAYERS)]
    return layers, torch.randn(VOCAB, HIDDEN, device=device, dtype=dtype) * 0.02


def floor_step_graph(batch: int, context: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(replay, release) of one captured floor step for `batch` requests at `context`."""
    device, dtype = "cuda", torch.bfloat16
    layers, embedding = _weights(device, dtype)
    key_cache = [torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=dtype)
                 for _ in range(NUM_LAYERS)]
    value_cache = [torch.randn_like(k) for k in key_cache]
    hidden = torch.randn(batch, HIDDEN, device=device, dtype=dtype)

    def step() -> torch.Tensor:
        x = hidden
        for index, w in enumerate(layers):
            h = F.rms_norm(x, (HIDDEN,))
            qkv = h @ w["qkv"]
            q = qkv[:, :NUM_HEADS * HEAD_DIM].view(-1, NUM_HEADS, 1, HEAD_DIM)
            a = F.scaled_dot_product_attention(q, key_cache[index], value_cache[index], enable_gqa=True)
            x = x + a.reshape(-1, NUM_HEADS * HEAD_DIM) @ w["o"]
            h = F.rms_norm(x, (HIDDEN,))
            gate, up = (h @ w["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["d"]
        return F.rms_norm(x, (HIDDEN,)) @ embedding.t()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    state = {"graph": graph, "caches": (key_cache, value_cache, layers)}

    def release() -> None:
        state.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    return graph.replay, release


def time_replays(replay: Callable[[], None], num_replays: int = 50) -> float:
    """Mean milliseconds of back-to-back replays (after warm-up)."""
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / num_replays


def roofline_ms(batch: int, context: int) -> float:
    return (WEIGHT_BYTES + batch * context * KV_BYTES_PER_TOKEN) / PEAK_BYTES_PER_S * 1e3
