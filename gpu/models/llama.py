"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Qwen3-MoE, gpt-oss) over a flat
varlen token batch.

The per-architecture differences are `ModelConfig` flags: `attention_bias` (Qwen2),
`qk_norm` (Qwen3), `rope_scaling` (Llama 3.1, YaRN), `tie_word_embeddings`, and for the
mixture-of-experts models the experts (gpu/models/moe.py replaces the MLP of MoE layers),
per-layer sliding windows, attention sinks and the o_proj bias (gpt-oss). q/k/v and
gate/up projections are fused into one matmul each; `load_weights` takes Hugging Face
tensor names and concatenates them. Any of the four projections of a layer may be FP8
(gpu/models/fp8_linear.py) or, on the CPU, packed int4 (gpu/models/int4_linear.py), and
the experts FP8 (gpu/models/moe.py; which ones, gpu/models/precision.py decides); the LM
head and the embeddings are always in the model dtype. Given a TP group (`tp`), the model holds
one rank's shard and communicates as gpu/models/parallel_layers.py describes (with
`sequence_parallel`, as gpu/models/sequence_parallel.py does); without one (the default)
it is the whole model and runs no collective. MoE models run unsharded only. Given a
pipeline stage (`pp`, gpu/distributed/pipeline.py), it holds that stage's layers only,
and the embedding or the final norm and head where the stage has them.

A layer is nine launches on CUDA (plus its collectives under TP): the residual add
fused into each RMSNorm (kernels/rms_norm.py), the q/k norm, rotary and KV write fused
after the qkv projection (kernels/qkv_prologue.py), attention, SiLU-and-multiply fused
(kernels/silu_mul.py) and four GEMMs. A decode step of a small model is bound by how many
kernels it launches, not by their bytes, so the count is what sets batch-1 latency (an
FP8 projection adds one launch: its activations' quantization). Layers
pass the residual stream alongside their output, so that each add happens inside the next
norm.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.attention.kv_cache_dtype import load_kv_scales
from gpu.models.config import MOE_ARCHITECTURES, ModelConfig, UnsupportedModelError
from gpu.models.decoder_layer import DecoderLayer, rank_and_size
from gpu.models.int4_linear import pack_int4_weights
from gpu.models.layers import RMSNorm, RotaryEmbedding, empty_parameter
from gpu.models.moe import SparseMoE
from gpu.models.parallel_layers import (
    Collectives,
    gather_vocab_logits,
    head_shard,
    overlay_rows,
    vocab_parallel_embedding,
    vocab_shard,
)
from gpu.models.precision import WeightPrecision
from gpu.models.sequence_parallel import token_layout
from gpu.models.weight_targets import Target, check_weights, layer_weight_targets
from gpu.prompt_embeds import EmbedsOverlay

if TYPE_CHECKING:
    from gpu.distributed.pipeline import PipelineStage

_NO_TP_MESSAGE = (
    "{} is a mixture-of-experts model, which runs on one GPU only for now "
    "(no tensor or expert parallelism); use --tensor-parallel-size 1"
)


class DecoderModel(nn.Module):
    """A Llama-family causal LM that runs a flat batch of tokens from many requests.

    `forward` returns the final-normed hidden states of every token; `compute_logits` turns
    the rows the caller needs (usually each request's last token) into float32 logits.
    With `tp`, this rank holds one shard and `compute_logits_local` gives its vocabulary
    slice of the logits (`num_kv_heads` is then the KV heads of this rank's cache).
    `precision` (gpu/models/precision.py) names the projections that are FP8; without it
    every weight is in `dtype`. With `pp`, `layers` are the stage's (`pp.layers` of the
    whole model's) and `forward` exchanges activations with the neighbouring stages.
    `sequence_parallel` shards the residual stream along tokens over the TP ranks
    (gpu/models/sequence_parallel.py); `forward` returns the same whole hidden states.
    """

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: Collectives | None = None,
        precision: WeightPrecision | None = None,
        pp: PipelineStage | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        if tp is not None and config.architecture in MOE_ARCHITECTURES:
            raise UnsupportedModelError(_NO_TP_MESSAGE.format(config.name or config.architecture))
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.pp = pp
        self.layout = token_layout(tp, sequence_parallel)
        self.precision = precision or WeightPrecision(dtype)
        self.vocab_shard = vocab_shard(config.vocab_size, *rank_and_size(tp))
        self.num_kv_heads = head_shard(config, *rank_and_size(tp)).num_kv_heads
        self.layer_indices = range(config.num_layers) if pp is None else pp.layers
        """The whole model's indices of `layers` (a pipeline stage holds some)."""
        self.has_embedding = pp is None or pp.is_first
        self.has_head = pp is None or pp.is_last
        vocab_rows = self.vocab_shard.num_rows
        # A stage without the embedding (head) holds an empty one: nothing to load.
        self.embed_tokens = empty_parameter(
            vocab_rows if self.has_embedding else 0, config.hidden_size, dtype=dtype, device=device
        )
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling_dict,
            device,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                attn_backend,
                dtype,
                device,
                self.rotary,
                tp,
                index,
                self.precision.layer_schemes(index),
                self.layout,
                self.precision.experts,
            )
            for index in self.layer_indices
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings and self.has_embedding
            else empty_parameter(
                vocab_rows if self.has_head else 0, config.hidden_size, dtype=dtype, device=device
            )
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int32/int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[
            torch.Tensor
        ],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        embeds: EmbedsOverlay | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """`embeds`: rows that replace the looked-up embeddings at some positions (prompt
        embeddings, gpu/prompt_embeds.py)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        num_tokens, layout = input_ids.shape[0], self.layout
        residual: torch.Tensor | None = None
        if self.pp is not None and not self.pp.is_first:
            hidden, residual = self.pp.recv(
                num_tokens, self.config.hidden_size, self.dtype, input_ids.device
            )
            hidden, residual = layout.shard(hidden), layout.shard(residual)
        else:
            hidden = self._embed(input_ids, embeds)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, kv_cache, attn_metadata)
        assert residual is not None  # every stage runs at least one layer
        if self.pp is not None and not self.pp.is_last:  # the next stage carries on
            hidden = layout.gather(hidden, num_tokens)
            self.pp.send(hidden, layout.gather(residual, num_tokens))
            return hidden
        return layout.gather(self.norm.add_forward(hidden, residual)[0], num_tokens)

    def _embed(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int32/int64
        embeds: EmbedsOverlay | None,
    ) -> torch.Tensor:  # the layout's rows [rows, hidden_size]
        if self.tp is None:
            hidden = F.embedding(input_ids, self.embed_tokens)
        else:
            hidden = vocab_parallel_embedding(input_ids, self.embed_tokens, self.vocab_shard)
        if embeds is not None:
            overlay_rows(hidden, embeds.token_index, embeds.rows, rank_and_size(self.tp)[0])
        return self.layout.reduce(hidden)

    def compute_logits(
        self,
        hidden: torch.Tensor,  # [num_logits, hidden_size]
        out: torch.Tensor | None = None,  # [num_logits, vocab_size] float32, written in place
    ) -> torch.Tensor:  # [num_logits, vocab_size] float32
        """float32 logits. On CUDA a bf16/fp16 head multiplies straight into float32
        (one GEMM, no half-precision logits and no cast kernel); elsewhere the logits are
        computed in the model dtype and converted. Under TP each rank's slice is gathered."""
        if self.tp is not None:
            logits = gather_vocab_logits(
                self.compute_logits_local(hidden), self.tp, self.config.vocab_size
            )
            return logits if out is None else out.copy_(logits)
        if hidden.is_cuda and self.dtype != torch.float32 and _mm_into_float32_works(hidden.device):
            if out is None:
                return torch.mm(hidden, self.lm_head.t(), out_dtype=torch.float32)
            return torch.mm(hidden, self.lm_head.t(), out_dtype=torch.float32, out=out)
        logits = F.linear(hidden, self.lm_head).float()
        return logits if out is None else out.copy_(logits)

    def compute_logits_local(
        self,
        hidden: torch.Tensor,  # [num_logits, hidden_size]
    ) -> torch.Tensor:  # [num_logits, vocab_shard.num_rows] in the model dtype
        """This rank's vocabulary slice of the logits (all of them without `tp`)."""
        return F.linear(hidden, self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], consume: bool = False) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Raises ValueError naming every missing, unexpected or mis-shaped tensor; nothing is
        partially loaded in that case. consume=True pops each tensor from `weights` (then a
        dict) as soon as it is copied and leaves it empty: once the caller holds no other
        reference, the device never holds much more than one copy of the weights.
        """
        optional = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        kv_scales = self._kv_scale_targets()  # optional; only an fp8 KV cache reads them
        check_weights(self._weight_targets(), weights, optional | kv_scales.keys())
        weights = load_kv_scales(weights, kv_scales, consume)
        for targets in self._weight_target_groups():
            for name, target in targets.items():
                target.copy_(weights[name])
                if consume:
                    del weights[name]  # type: ignore[attr-defined]
        if consume:
            weights.clear()  # type: ignore[attr-defined]
        pack_int4_weights(self)

    def _kv_scale_targets(self) -> dict[str, torch.Tensor]:
        """Loader names of the KV cache scales (gpu/attention/kv_cache_dtype.py) -> each
        layer's [] float32 buffer."""
        return {
            f"model.layers.{index}.self_attn.{name}": getattr(layer.self_attn, name)
            for index, layer in self._indexed_layers()
            for name in ("k_scale", "v_scale")
        }

    def _indexed_layers(self) -> list[tuple[int, DecoderLayer]]:
        """(the whole model's index, layer) for each layer this model holds."""
        layers = cast("list[DecoderLayer]", list(self.layers))
        return list(zip(self.layer_indices, layers, strict=True))

    def hf_weight_views(self) -> dict[str, torch.Tensor]:
        """Hugging Face tensor name -> a view of the parameter storage holding it (the tied
        head is left out, and so are experts whose checkpoint layout no view of the
        parameters gives: gpt-oss's interleaved gate/up): lets another framework run on
        these very weights."""
        return {
            name: target
            for name, target in self._weight_targets().items()
            if isinstance(target, torch.Tensor)
        }

    def _weight_targets(self) -> dict[str, Target]:
        """HF tensor name -> the (view of the) parameter it is copied into."""
        targets = self._model_weight_targets()
        for index, layer in self._indexed_layers():
            targets.update(layer_weight_targets(f"model.layers.{index}.", layer, self.config))
        return targets

    def _weight_target_groups(self) -> Iterator[dict[str, Target]]:
        """`_weight_targets` in parts, layer by layer; a layer's experts are allocated
        only when its part is asked for (gpu/models/moe.py)."""
        yield self._model_weight_targets()
        for index, layer in self._indexed_layers():
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.materialize()
            yield layer_weight_targets(f"model.layers.{index}.", layer, self.config)

    def _model_weight_targets(self) -> dict[str, Target]:
        """The embedding, final norm and head, where this model (pipeline stage) has them;
        a tied head without the embedding beside it loads the embedding's tensor."""
        targets: dict[str, Target] = {}
        if self.has_embedding:
            targets["model.embed_tokens.weight"] = self.embed_tokens.data
        if not self.has_head:
            return targets
        targets["model.norm.weight"] = self.norm.weight.data
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data
        elif not self.has_embedding:
            targets["model.embed_tokens.weight"] = self.lm_head.data
        return targets


@functools.cache
def _mm_into_float32_works(device: torch.device) -> bool:
    """Whether this torch build multiplies half-precision matrices into float32 on `device`."""
    a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
    out = torch.empty(4, 2, dtype=torch.float32, device=device)[:2]
    try:
        plain = torch.mm(a, a.t(), out_dtype=torch.float32)
        torch.mm(a, a.t(), out_dtype=torch.float32, out=out)
        return plain.dtype == torch.float32 and bool((out == 8.0).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False
