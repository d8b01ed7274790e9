"""The transformers arms of `benchmarks.throughput`: `generate` on static batches and
`generate_batch` (its continuous batching), on a transformers model whose parameters are
views of tandem's loaded weights.

tandem fuses q/k/v and gate/up into single matrices; their row blocks are contiguous, so
every Hugging Face parameter can be a view of tandem's storage: the transformers model
costs no extra weight memory and computes with bit-identical weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel


@dataclass(frozen=True, slots=True)
class HFRun:
    elapsed_s: float
    num_output_tokens: int
    num_prompts: int
    batch_size: int | None


def _sampling_kwargs(output_len: int) -> dict[str, Any]:
    # The same distribution as tandem's arm: T=1, no top-k/top-p cut; no EOS, so every
    # output has exactly max_new_tokens tokens.
    return dict(
        max_new_tokens=output_len,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
    )


@torch.inference_mode()
def run_hf_static(hf: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> HFRun:
    """`generate` over consecutive batches of equal-length prompts (no padding needed)."""
    device = hf.device
    _synchronize()
    started = time.perf_counter()
    num_tokens = 0
    for start in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[start : start + batch_size], device=device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **_sampling_kwargs(output_len))
        num_tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    _synchronize()
    return HFRun(time.perf_counter() - started, num_tokens, len(prompts), batch_size)


# No inference_mode here: generate_batch runs its loop in a background thread, outside
# inference mode, on tensors it created in this one.
@torch.no_grad()
def run_hf_continuous(hf: Any, prompts: list[list[int]], output_len: int) -> HFRun:
    """`generate_batch`: transformers' continuous batching with its paged cache."""
    from transformers import GenerationConfig

    config = GenerationConfig(**_sampling_kwargs(output_len))
    _synchronize()
    started = time.perf_counter()
    outputs = hf.generate_batch(inputs=prompts, generation_config=config)
    _synchronize()
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(getattr(o, "generated_tokens", ()) or ()) for o in outputs.values())
    if num_tokens == 0:  # its loop logs errors and returns empty outputs instead of raising
        raise RuntimeError(f"generate_batch returned no tokens for {len(prompts)} prompts")
    return HFRun(elapsed, num_tokens, len(prompts), None)


def warm_up_hf(hf: Any, prompts: list[list[int]]) -> None:
    """Compile/allocate once outside the timed region: one short batch."""
    run_hf_static(hf, prompts[:8], 4, 8)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_config(config: ModelConfig, dtype: torch.dtype) -> Any:
    """The transformers config of the same architecture (eos disabled: fixed-length runs)."""
    import transformers

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling_dict:
        rope = {**config.rope_scaling_dict, "rope_theta": config.rope_theta}
    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        dtype=dtype,
    )
    if config.architecture == "qwen3":
        return transformers.Qwen3Config(**common)
    if config.architecture == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common, attention_bias=config.attention_bias)


def hf_model_sharing_weights(model: DecoderModel, attn_implementation: str = "sdpa") -> Any:
    """A transformers CausalLM (eval mode) whose parameters are views of `model`'s."""
    import transformers

    config = model.config
    dtype = model.embed_tokens.dtype
    device = model.embed_tokens.device
    hf_cfg = hf_config(config, dtype)
    hf_cfg._attn_implementation = attn_implementation
    # Built on the meta device (no memory), then every parameter is assigned a view.
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    views = {name: tensor for name, tensor in model.hf_weight_views().items()}
    if config.tie_word_embeddings:
        views["lm_head.weight"] = views["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(views, strict=False, assign=True)
    missing = [name for name in missing if "rotary" not in name]
    if missing or unexpected:
        raise ValueError(
            f"weights do not map onto transformers: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    _materialise_buffers(hf, hf_cfg, device)
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def _materialise_buffers(hf: Any, hf_cfg: Any, device: torch.device) -> None:
    """Rebuild the (non-persistent) rotary buffers, which the meta build left empty."""
    rotary = hf.model.rotary_emb
    with torch.device(device):  # its constructor's signature differs across versions
        hf.model.rotary_emb = type(rotary)(hf_cfg)
    for name, buffer in hf.named_buffers():
        if buffer.is_meta:
            raise ValueError(f"transformers buffer {name} was not materialised")
