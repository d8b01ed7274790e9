"""One decoder layer of the Llama family: attention (q/k/v fused, the q/k norm, rotary and
KV write fused after it, sinks and sliding windows where the config has them) and the MLP
or the experts, each behind a residual-add RMSNorm. Under tensor parallelism each holds
one rank's heads and MLP slice; the token layout (gpu/models/sequence_parallel.py) says
how their partial sums are reduced and gathered."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.models.config import ModelConfig
from gpu.models.fp8_linear import linear, projection
from gpu.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, empty_parameter
from gpu.models.moe import SparseMoE
from gpu.models.parallel_layers import Collectives, head_shard, intermediate_shard
from gpu.models.precision import (
    DOWN_GROUP,
    GATE_UP_GROUP,
    O_GROUP,
    QKV_GROUP,
    Fp8Scheme,
    ProjectionScheme,
)
from gpu.models.sequence_parallel import TokenLayout, token_layout
from kernels.qkv_prologue import qkv_prologue


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        rotary: RotaryEmbedding,
        tp: Collectives | None = None,
        layer_index: int = 0,
        schemes: Mapping[str, ProjectionScheme] | None = None,
    ) -> None:
        super().__init__()
        schemes = schemes or {}
        heads = head_shard(config, *rank_and_size(tp))
        self.rotary = rotary
        self.eps = config.rms_norm_eps
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = heads.num_heads * config.head_dim
        self.kv_size = heads.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.attn_backend = attn_backend
        # rows: [q_proj | k_proj | v_proj]
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = projection(
            qkv_rows, config.hidden_size, dtype, device, schemes.get(QKV_GROUP)
        )
        self.qkv_bias = (
            empty_parameter(qkv_rows, dtype=dtype, device=device) if config.attention_bias else None
        )
        self.o_proj = projection(
            config.hidden_size, self.q_size, dtype, device, schemes.get(O_GROUP)
        )
        self.o_bias = (
            empty_parameter(config.hidden_size, dtype=dtype, device=device)
            if config.o_proj_bias
            else None
        )
        # float32 like the backends' softmax, whatever the model dtype
        self.sinks = (
            empty_parameter(self.num_heads, dtype=torch.float32, device=device)
            if config.attention_sinks
            else None
        )
        # A float8 KV cache holds k / k_scale and v / v_scale (1.0 unless the checkpoint
        # has them); device scalars, so a CUDA graph reads what they hold at replay.
        self.k_scale: torch.Tensor
        self.v_scale: torch.Tensor
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32, device=device))
        self.sliding_window = config.layer_sliding_window(layer_index)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]: this rank's partial sum under TP
        num_tokens = hidden.shape[0]
        qkv = linear(hidden, self.qkv_proj, self.qkv_bias)
        query = qkv_prologue(
            qkv, positions, self.rotary.cos_cache, self.rotary.sin_cache,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            self.eps, kv_cache, attn_metadata.slot_mapping,
            self.num_heads, self.num_kv_heads, self.head_dim, self.k_scale, self.v_scale,
        )  # fmt: skip
        out = self.attn_backend.attend(
            query, kv_cache, attn_metadata, self.scale,
            sliding_window=self.sliding_window, sinks=self.sinks,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip
        return linear(out.reshape(num_tokens, self.q_size), self.o_proj, self.o_bias)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        rotary: RotaryEmbedding,
        tp: Collectives | None = None,
        layer_index: int = 0,
        schemes: Mapping[str, ProjectionScheme] | None = None,
        layout: TokenLayout | None = None,
        expert_scheme: Fp8Scheme | None = None,
    ) -> None:
        """`schemes`: this layer's FP8 / int4 projections; `expert_scheme`: its experts'
        FP8 (gpu/models/precision.py)."""
        super().__init__()
        schemes = schemes or {}
        self.layout = layout or token_layout(tp, sequence_parallel=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(
            config, attn_backend, dtype, device, rotary, tp, layer_index, schemes
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device
        )
        self.mlp: SwiGLUMLP | SparseMoE
        if config.is_moe_layer(layer_index):
            self.mlp = SparseMoE(config, dtype, device, expert_scheme)
        else:
            _, intermediate_size = intermediate_shard(config, *rank_and_size(tp))
            self.mlp = SwiGLUMLP(
                config.hidden_size,
                intermediate_size,
                dtype,
                device,
                schemes.get(GATE_UP_GROUP),
                schemes.get(DOWN_GROUP),
            )

    def forward(
        self,
        hidden: torch.Tensor,  # [rows, hidden_size]: the previous MLP's output (rows: the
        residual: torch.Tensor | None,  # layout's, e.g. a token shard); None in layer 0
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream before it)
        num_tokens, layout = positions.shape[0], self.layout
        normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn_out = self.self_attn(
            layout.gather(normed, num_tokens), positions, kv_cache, attn_metadata
        )
        normed, residual = self.post_attention_layernorm.add_forward(
            layout.reduce(attn_out), residual
        )
        return layout.reduce(self.mlp(layout.gather(normed, num_tokens))), residual


def rank_and_size(tp: Collectives | None) -> tuple[int, int]:
    """(this rank, ranks) of a TP group; (0, 1) without one."""
    return (0, 1) if tp is None else (tp.rank, tp.world_size)
