"""--compile-level for the V1 runner: torch.compile of the model between attention calls.

What compiles: every token-wise part of the decoder, as three functions that take the
weights as arguments, so one compiled graph serves every layer:
- first: embedding, rotary cos/sin, layer 0's input RMSNorm and q/k/v projection (with
  q/k norm and rotary);
- middle: layer i's output projection, residual, post-attention RMSNorm, SwiGLU MLP and
  residual, then layer i+1's input RMSNorm and q/k/v projection (run once per layer
  boundary);
- last: the last layer's output half and the final RMSNorm.
Attention itself (KV cache writes, paged attention) runs eagerly in between, as do the
LM head and sampling. The math is that of gpu/models' kernel references
(gpu/runner_v1/compiled_layers.py); inductor fuses
the element-wise work (norms, residual adds, SiLU, rotary) around the matmuls.

Levels: 0 = eager (default); 1 = torch.compile with inductor's default mode;
2 = mode "max-autotune-no-cudagraphs" (autotuned GEMM and Triton configurations on a GPU:
slower startup, faster steps). No CUDA graphs: the batch shape changes every step on V1.
The token dimension is dynamic (one graph for every batch size >= 2, one for a single
token), so a server compiles at startup (`warm_up`) and never during serving.

Dense Llama/Qwen decoders only: a model with mixture-of-experts layers, attention sinks,
sliding windows or an o_proj bias (Qwen3-MoE, gpt-oss) is refused at startup, since the
traced pieces above do not hold those parts; so are FP8 projections (gpu/models/fp8_linear.py;
on CPU an FP8 checkpoint is dequantized at load and compiles as any other) and packed int4
ones (gpu/models/int4_linear.py: --quantization none compiles a GGUF's float32 model).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionMetadata
from gpu.models.config import ModelConfig, UnsupportedModelError
from gpu.models.decoder_layer import DecoderLayer
from gpu.models.fp8_linear import Projection
from gpu.models.layers import SwiGLUMLP
from gpu.models.llama import DecoderModel
from gpu.runner_v1.compiled_layers import (
    HeadShape,
    finish_layer,
    project_qkv,
    rms_norm,
    rotary_cos_sin,
)

log = structlog.get_logger("tandem.compile")

COMPILE_MODES = {1: "default", 2: "max-autotune-no-cudagraphs"}
_ATTRIBUTE = "_compiled_decoders"


def compiled_decoder(model: DecoderModel, level: int) -> CompiledDecoder:
    """The model's compiled forward at `level` (1 or 2), compiled and warmed up once per
    model and level (kept on the model, so it lives exactly as long)."""
    if level not in COMPILE_MODES:
        raise ValueError(f"compile level must be one of {sorted(COMPILE_MODES)}, got {level}")
    check_compilable(model.config, level, model.precision.runs_fp8, model.precision.runs_int4)
    per_model: dict[int, CompiledDecoder] = model.__dict__.setdefault(_ATTRIBUTE, {})
    if level not in per_model:
        per_model[level] = CompiledDecoder(model, level)
        per_model[level].warm_up()
    return per_model[level]


def check_compilable(
    config: ModelConfig, level: int, runs_fp8: bool = False, runs_int4: bool = False
) -> None:
    """Raise UnsupportedModelError when the compiled pieces would leave out a part of
    `config`'s model (see the module docstring), or when its projections run as FP8 or
    packed int4 GEMMs (gpu/models/precision.py), which the compiled pieces do not trace."""
    quantized = ["FP8 projections"] * runs_fp8 + ["int4 projections"] * runs_int4
    untraced = _untraced_parts(config) + quantized
    if untraced:
        raise UnsupportedModelError(
            f"--compile-level {level} cannot compile {config.architecture} "
            f"({', '.join(untraced)}); serve it with --compile-level 0"
            + (" (or --quantization none)" if quantized else "")
        )


def _untraced_parts(config: ModelConfig) -> list[str]:
    parts = {
        "mixture-of-experts layers": config.is_moe,
        "attention sinks": config.attention_sinks,
        "sliding-window layers": config.layer_types is not None
        and "sliding_attention" in config.layer_types,
        "an o_proj bias": config.o_proj_bias,
    }
    return [name for name, present in parts.items() if present]


def _pre_weights(layer: DecoderLayer) -> tuple[torch.Tensor | None, ...]:
    attn = layer.self_attn
    return (
        layer.input_layernorm.weight,
        _plain(attn.qkv_proj),
        attn.qkv_bias,
        None if attn.q_norm is None else attn.q_norm.weight,
        None if attn.k_norm is None else attn.k_norm.weight,
    )


def _post_weights(layer: DecoderLayer) -> tuple[torch.Tensor, ...]:
    mlp = layer.mlp
    assert isinstance(mlp, SwiGLUMLP)  # check_compilable refuses MoE layers
    return (
        _plain(layer.self_attn.o_proj),
        layer.post_attention_layernorm.weight,
        _plain(mlp.gate_up_proj),
        _plain(mlp.down_proj),
    )


def _plain(weight: Projection) -> torch.Tensor:
    """A projection's [N, K] weight; check_compilable refuses FP8 and int4 ones first."""
    assert isinstance(weight, torch.Tensor)
    return weight


class CompiledDecoder:
    """Callable like `DecoderModel.forward`, with the token-wise parts compiled."""

    def __init__(self, model: DecoderModel, level: int) -> None:
        if model.tp is not None:
            raise ValueError(
                "torch.compile runs on the V1 runner, which serves unsharded models "
                "only (tensor parallelism needs V2)"
            )
        self.model = model
        self.level = level
        self.compile_time_s = 0.0
        pieces = _make_pieces(model)
        options: dict[str, Any] = {
            "mode": COMPILE_MODES[level],
            "fullgraph": True,
            "dynamic": False,
        }
        self._first = torch.compile(pieces[0], **options)
        self._middle = torch.compile(pieces[1], **options)
        self._last = torch.compile(pieces[2], **options)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self._run(
            input_ids,
            positions,
            lambda i, q, k, v: _attend(self.model.layers[i], q, k, v, kv_caches[i], attn_metadata),
        )

    def warm_up(self) -> float:
        """Compile for one token and for any larger batch, without touching a KV cache
        (attention is replaced by its output's shape); returns the seconds it took."""
        started = time.perf_counter()
        device = self.model.embed_tokens.device
        with torch.inference_mode():
            for num_tokens in (2,):
                ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
                self._run(ids, ids.clone(), lambda _i, q, _k, _v: q)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.compile_time_s = time.perf_counter() - started
        log.info(
            "torch_compile_ready",
            level=self.level,
            mode=COMPILE_MODES[self.level],
            compile_time_s=round(self.compile_time_s, 2),
        )
        return self.compile_time_s

    def _run(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        model, layers = self.model, self.model.layers
        _mark_token_dim_dynamic(input_ids, positions)
        hidden, cos, sin, q, k, v = self._first(
            input_ids,
            positions,
            model.embed_tokens,
            model.rotary.cos_cache,
            model.rotary.sin_cache,
            *_pre_weights(layers[0]),
        )
        for i in range(len(layers) - 1):
            out = attend(i, q, k, v)
            _mark_token_dim_dynamic(out, hidden, cos, sin)
            hidden, q, k, v = self._middle(
                out, hidden, *_post_weights(layers[i]), *_pre_weights(layers[i + 1]), cos, sin
            )
        out = attend(len(layers) - 1, q, k, v)
        _mark_token_dim_dynamic(out, hidden)
        return self._last(out, hidden, *_post_weights(layers[-1]), model.norm.weight)


def _attend(
    layer: DecoderLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
) -> torch.Tensor:
    attn = layer.self_attn
    return attn.attn_backend.forward(
        q, k, v, kv_cache, attn_metadata, attn.scale, k_scale=attn.k_scale, v_scale=attn.v_scale
    )


def _mark_token_dim_dynamic(*tensors: torch.Tensor) -> None:
    # Unbacked: one graph for every number of tokens, a single token included (a backed
    # dynamic size would be specialised at 1 and compile a second graph).
    for tensor in tensors:
        torch._dynamo.decorators.mark_unbacked(tensor, 0)


def _make_pieces(model: DecoderModel) -> tuple[Callable[..., Any], ...]:
    """The three compiled functions; model constants are closed over, tensors passed in."""
    attn = model.layers[0].self_attn
    shape = HeadShape(attn.num_heads, attn.num_kv_heads, attn.head_dim)
    eps, dtype = model.config.rms_norm_eps, model.dtype

    def first(
        input_ids, positions, embed, cos_cache, sin_cache, norm_w, qkv, qkv_b, q_norm_w, k_norm_w
    ):
        hidden = F.embedding(input_ids, embed)
        cos, sin = rotary_cos_sin(cos_cache, sin_cache, positions, dtype)
        q, k, v = project_qkv(
            rms_norm(hidden, norm_w, eps), qkv, qkv_b, q_norm_w, k_norm_w, cos, sin, shape, eps
        )
        return hidden, cos, sin, q, k, v

    def middle(
        attn,
        hidden,
        o_proj,
        post_norm_w,
        gate_up,
        down,
        norm_w,
        qkv,
        qkv_b,
        q_norm_w,
        k_norm_w,
        cos,
        sin,
    ):
        hidden = finish_layer(attn, hidden, o_proj, post_norm_w, gate_up, down, eps)
        q, k, v = project_qkv(
            rms_norm(hidden, norm_w, eps), qkv, qkv_b, q_norm_w, k_norm_w, cos, sin, shape, eps
        )
        return hidden, q, k, v

    def last(attn, hidden, o_proj, post_norm_w, gate_up, down, final_norm_w):
        hidden = finish_layer(attn, hidden, o_proj, post_norm_w, gate_up, down, eps)
        return rms_norm(hidden, final_norm_w, eps)

    return first, middle, last
