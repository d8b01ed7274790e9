"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) over a flat varlen token batch.

The per-architecture differences are `ModelConfig` flags: `attention_bias` (Qwen2),
`qk_norm` (Qwen3), `rope_scaling` (Llama 3.1) and `tie_word_embeddings`. q/k/v and
gate/up projections are fused into one matmul each; `load_weights` takes Hugging Face
tensor names and concatenates them. Given a TP group (`tp`), the model holds one rank's
shard and communicates as gpu/models/parallel_layers.py describes; without one (the
default) it is the whole model and runs no collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.models.config import ModelConfig
from gpu.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    apply_rotary,
    empty_parameter,
    rms_norm,
    swiglu_mlp,
)
from gpu.models.parallel_layers import (
    Collectives,
    gather_vocab_logits,
    head_shard,
    intermediate_shard,
    vocab_parallel_embedding,
    vocab_shard,
)

# Buffers that some checkpoints carry but that are recomputed here.
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


class HeadShape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: Collectives | None = None,
    ) -> None:
        super().__init__()
        heads = head_shard(config, *_rank_and_size(tp))
        self.tp = tp
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = heads.num_heads * config.head_dim
        self.kv_size = heads.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.head_shape = HeadShape(heads.num_heads, heads.num_kv_heads, config.head_dim)
        self.norm_eps = config.rms_norm_eps
        self.attn_backend = attn_backend
        # rows: [q_proj | k_proj | v_proj]
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = empty_parameter(qkv_rows, config.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = (
            empty_parameter(qkv_rows, dtype=dtype, device=device) if config.attention_bias else None
        )
        self.o_proj = empty_parameter(config.hidden_size, self.q_size, dtype=dtype, device=device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        query, key, value = self.project(hidden, cos, sin)
        out = self.attn_backend.forward(query, key, value, kv_cache, attn_metadata, self.scale)
        out = F.linear(out.reshape(num_tokens, self.q_size), self.o_proj)
        return out if self.tp is None else self.tp.all_reduce(out)

    def project(
        self,
        normed: torch.Tensor,  # [num_tokens, hidden_size], after the input RMSNorm
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v (see project_qkv)
        return project_qkv(
            normed, self.qkv_proj, self.qkv_bias,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            cos, sin, self.head_shape, self.norm_eps)


def project_qkv(
    normed: torch.Tensor,  # [num_tokens, hidden_size]
    qkv_proj: torch.Tensor,  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden_size]
    qkv_bias: torch.Tensor | None,  # [(num_heads + 2 * num_kv_heads) * head_dim]
    q_norm_weight: torch.Tensor | None,  # [head_dim] (Qwen3 q/k norm)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    shape: HeadShape,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim],
    q and k normed (if the model norms them) and rotated."""
    num_tokens = normed.shape[0]
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    qkv = F.linear(normed, qkv_proj, qkv_bias)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query = query.view(num_tokens, shape.num_heads, shape.head_dim)
    key = key.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    value = value.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    if q_norm_weight is not None and k_norm_weight is not None:
        query = rms_norm(query, q_norm_weight, norm_eps)
        key = rms_norm(key, k_norm_weight, norm_eps)
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value


def finish_layer(
    attn: torch.Tensor,  # [num_tokens, num_heads, head_dim], the attention backend's output
    hidden: torch.Tensor,  # [num_tokens, hidden_size], the layer's input (residual stream)
    o_proj: torch.Tensor,  # [hidden_size, num_heads * head_dim]
    post_norm_weight: torch.Tensor,  # [hidden_size]
    gate_up_proj: torch.Tensor,  # [2 * intermediate_size, hidden_size]
    down_proj: torch.Tensor,  # [hidden_size, intermediate_size]
    norm_eps: float,
) -> torch.Tensor:  # [num_tokens, hidden_size], the layer's output
    """The rest of an unsharded layer after attention, with the ops of `Attention.forward`
    and `DecoderLayer.forward`: output projection and residual, then the post-attention
    RMSNorm, MLP and residual (a sharded layer all-reduces in between: see those)."""
    hidden = hidden + F.linear(attn.reshape(attn.shape[0], -1), o_proj)
    return hidden + swiglu_mlp(rms_norm(hidden, post_norm_weight, norm_eps), gate_up_proj, down_proj)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, attn_backend, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        _, intermediate_size = intermediate_shard(config, *_rank_and_size(tp))
        self.mlp = SwiGLUMLP(config.hidden_size, intermediate_size, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, attn_metadata)
        hidden = hidden + attn_out
        mlp_out = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + (mlp_out if self.tp is None else self.tp.all_reduce(mlp_out))


class DecoderModel(nn.Module):
    """A Llama-family causal LM that runs a flat batch of tokens from many requests.

    `forward` returns the final-normed hidden states of every token; `compute_logits` turns
    the rows the caller needs (usually each request's last token) into float32 logits.
    With `tp`, this rank holds one shard and `compute_logits_local` gives its vocabulary
    slice of the logits (`num_kv_heads` is then the KV heads of this rank's cache).
    """

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.vocab_shard = vocab_shard(config.vocab_size, *_rank_and_size(tp))
        self.num_kv_heads = head_shard(config, *_rank_and_size(tp)).num_kv_heads
        vocab_rows = self.vocab_shard.num_rows
        self.embed_tokens = empty_parameter(vocab_rows, config.hidden_size, dtype=dtype,
                                            device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attn_backend, dtype, device, tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else empty_parameter(vocab_rows, config.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling_dict,
            device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int32/int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        if self.tp is None:
            hidden = F.embedding(input_ids, self.embed_tokens)
        else:
            hidden = vocab_parallel_embedding(input_ids, self.embed_tokens, self.vocab_shard, self.tp)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden)

    def compute_logits(
        self,
        hidden: torch.Tensor,  # [num_logits, hidden_size]
    ) -> torch.Tensor:  # [num_logits, vocab_size] float32
        if self.tp is None:
            return F.linear(hidden, self.lm_head).float()
        return gather_vocab_logits(self.compute_logits_local(hidden), self.tp, self.config.vocab_size)

    def compute_logits_local(
        self,
        hidden: torch.Tensor,  # [num_logits, hidden_size]
    ) -> torch.Tensor:  # [num_logits, vocab_shard.num_rows] in the model dtype
        """This rank's vocabulary slice of the logits (all of them without `tp`)."""
        return F.linear(hidden, self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Raises ValueError naming every missing, unexpected or mis-shaped tensor; nothing is
        partially loaded in that case.
        """
        targets = self._weight_targets()
        optional = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        names = [n for n in weights if not n.endswith(_IGNORED_WEIGHT_SUFFIXES)]
        missing = sorted(set(targets) - set(names))
        unexpected = sorted(set(names) - set(targets) - optional)
        mis_shaped = [
            f"{name}: expected {tuple(targets[name].shape)}, got {tuple(weights[name].shape)}"
            for name in names
            if name in targets and weights[name].shape != targets[name].shape
        ]
        problems = [
            f"{label} ({len(items)}): {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mis_shaped))
            if items
        ]
        if problems:
            raise ValueError("cannot load weights into DecoderModel: " + "; ".join(problems))
        for name, target in targets.items():
            target.copy_(weights[name])

    def hf_weight_views(self) -> dict[str, torch.Tensor]:
        """Hugging Face tensor name -> a view of the parameter storage holding it (the tied
        head is left out): lets another framework run on these very weights."""
        return self._weight_targets()

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the (view of the) parameter it is copied into."""
        targets: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data
        for index, layer in enumerate(self.layers):
            targets.update(_layer_weight_targets(f"model.layers.{index}.", layer))
        return targets


def _layer_weight_targets(prefix: str, layer: DecoderLayer) -> dict[str, torch.Tensor]:
    attn = layer.self_attn
    q_rows, kv_rows = attn.q_size, attn.kv_size
    qkv_splits = {"q_proj": (0, q_rows), "k_proj": (q_rows, kv_rows), "v_proj": (q_rows + kv_rows, kv_rows)}
    targets = {
        f"{prefix}input_layernorm.weight": layer.input_layernorm.weight.data,
        f"{prefix}post_attention_layernorm.weight": layer.post_attention_layernorm.weight.data,
        f"{prefix}self_attn.o_proj.weight": attn.o_proj.data,
        f"{prefix}mlp.down_proj.weight": layer.mlp.down_proj.data,
    }
    for proj, (start, rows) in qkv_splits.items():
        targets[f"{prefix}self_attn.{proj}.weight"] = attn.qkv_proj.data.narrow(0, start, rows)
        if attn.qkv_bias is not None:
            targets[f"{prefix}self_attn.{proj}.bias"] = attn.qkv_bias.data.narrow(0, start, rows)
    if attn.q_norm is not None and attn.k_norm is not None:
        targets[f"{prefix}self_attn.q_norm.weight"] = attn.q_norm.weight.data
        targets[f"{prefix}self_attn.k_norm.weight"] = attn.k_norm.weight.data
    intermediate = layer.mlp.intermediate_size
    targets[f"{prefix}mlp.gate_proj.weight"] = layer.mlp.gate_up_proj.data.narrow(0, 0, intermediate)
    targets[f"{prefix}mlp.up_proj.weight"] = layer.mlp.gate_up_proj.data.narrow(0, intermediate, intermediate)
    return targets


def _rank_and_size(tp: Collectives | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.world_size)
