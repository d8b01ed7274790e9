"""The transformers arms of `benchmarks.throughput`: `generate` on static batches and
`generate_batch` (its continuous batching), on a transformers model built from tandem's
loaded weights.

tandem fuses q/k/v and gate/up into single matrices; their row blocks are contiguous, so
every dense Hugging Face parameter is a view of tandem's storage: the transformers model
costs no extra weight memory and computes with bit-identical weights. Qwen3-MoE's stacked
experts (gate_up_proj [E, 2I, H] as [gate; up] rows, down_proj [E, H, I]) are tandem's own
tensors, so they are views too.

gpt-oss is the exception. transformers keeps its experts as gate_up_proj [E, H, 2I] with
gate and up columns interleaved, which no view of tandem's [E, 2I, H] [gate; up] tensor
gives, and runs MXFP4 experts only with kernels fetched from the hub. The transformers
model of a gpt-oss checkpoint therefore holds its own copy, in the model dtype, of the
gate/up experts, and, when tandem holds MXFP4 experts, of the down experts too
(dequantized); down_proj of unquantized experts stays a view. `hf_own_weight_bytes` gives
the size: for gpt-oss-20b 38.2 GB (35.6 GiB) of bf16 experts beside tandem's weights
(benchmarks.throughput frees tandem's KV cache and graphs before it builds this model);
gpt-oss-120b would need 229 GB and is refused (the check runs on CUDA). gpt-oss runs
transformers' eager attention (its SDPA path has no attention sinks; flex_attention, CUDA
only, is allowed on request), which honours the sinks and, through its masks, the sliding
windows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.models.moe import SparseMoE
from kernels.fp8_experts import Fp8Experts, dequantize_fp8_experts
from kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4


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


MIN_STATIC_BATCH = 8


def run_hf_static_fitting(
    hf: Any, prompts: list[list[int]], output_len: int, batch_size: int
) -> tuple[HFRun, list[int]]:
    """`run_hf_static` at `batch_size`, or, where a batch runs out of device memory, at half
    of it, down to MIN_STATIC_BATCH: transformers' fairest figure is its largest batch that
    fits (gpt-oss-20b's 128 did not beside its own 38 GB of bf16 experts on an H100).
    Returns the run and the batch sizes that did not fit."""
    too_large: list[int] = []
    while True:
        try:
            return run_hf_static(hf, prompts, output_len, batch_size), too_large
        except torch.OutOfMemoryError:
            too_large.append(batch_size)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if batch_size // 2 < MIN_STATIC_BATCH:
                raise
            batch_size //= 2


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


SINK_ATTENTION_IMPLEMENTATIONS = ("eager", "flex_attention")
"""transformers attention implementations that apply gpt-oss's attention sinks."""


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
    if config.architecture == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            attention_bias=config.attention_bias,
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            mlp_only_layers=list(config.mlp_only_layers),
            decoder_sparse_step=config.decoder_sparse_step,
            use_sliding_window=config.sliding_window is not None,
            sliding_window=config.sliding_window,
        )
    if config.architecture == "gpt_oss":
        # swiglu alpha/limit are set on the experts (hf_model_sharing_weights): older
        # transformers releases hard-code them instead of reading the config
        return transformers.GptOssConfig(
            **{**common, "intermediate_size": config.moe_intermediate_size},
            attention_bias=config.attention_bias,
            num_local_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            layer_types=list(config.layer_types or ("full_attention",) * config.num_layers),
            sliding_window=config.sliding_window,
        )
    if config.architecture == "qwen3":
        return transformers.Qwen3Config(**common)
    if config.architecture == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common, attention_bias=config.attention_bias)


def hf_own_weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of weights the transformers model holds itself rather than as views of
    tandem's, in a `dtype_bytes`-byte dtype: gpt-oss's experts in transformers' layout
    (gate/up with their bias; down too when tandem holds them in MXFP4); 0 otherwise."""
    if config.architecture != "gpt_oss":
        return 0
    hidden, width = config.hidden_size, config.moe_intermediate_size
    per_expert = 2 * width * hidden + 2 * width + (width * hidden if config.mxfp4_experts else 0)
    return config.num_moe_layers * config.num_experts * per_expert * dtype_bytes


def hf_room_problem(
    config: ModelConfig, dtype: torch.dtype, free_bytes: int, total_bytes: int
) -> str | None:
    """Why the transformers model cannot be built beside tandem's on a device with
    `free_bytes` of `total_bytes` free, or None when its own weights fit."""
    needed = hf_own_weight_bytes(config, dtype.itemsize)
    if needed <= free_bytes:
        return None
    quantized = " (dequantized from MXFP4)" if config.mxfp4_experts else ""
    remedy = (
        "lower tandem's --gpu-memory-utilization to leave room"
        if needed < total_bytes
        else "it cannot run beside tandem on this device"
    )
    return (
        f"{config.name or config.architecture}: the transformers arm needs "
        f"{needed / 1e9:.1f} GB for its own {str(dtype).removeprefix('torch.')} copy of "
        f"the experts{quantized}, which transformers lays out differently from tandem, but "
        f"{free_bytes / 1e9:.1f} GB of {total_bytes / 1e9:.0f} GB is free; {remedy}"
    )


def hf_model_sharing_weights(model: DecoderModel, attn_implementation: str | None = None) -> Any:
    """A transformers CausalLM (eval mode) whose parameters are views of `model`'s, except
    gpt-oss's experts (see the module docstring). attn_implementation: transformers'
    name; None picks sdpa, or eager for models with attention sinks. Raises ValueError
    when the model's own weights do not fit in the device's free memory, or are FP8 or
    packed int4."""
    import transformers

    if model.precision.runs_fp8 or model.precision.runs_int4:
        kind = "FP8" if model.precision.runs_fp8 else "packed int4"
        raise ValueError(
            f"tandem's projections are {kind} (--quantization): nothing to share; "
            "--quantization none runs them unquantized"
        )
    config = model.config
    dtype = model.embed_tokens.dtype
    device = model.embed_tokens.device
    _check_room(config, dtype, device)
    hf_cfg = hf_config(config, dtype)
    hf_cfg._attn_implementation = _attention_implementation(config, attn_implementation)
    # Built on the meta device (no memory), then every parameter is assigned a tensor.
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    weights = hf_weights(model)
    missing, unexpected = hf.load_state_dict(weights, strict=False, assign=True)
    missing = [name for name in missing if "rotary" not in name]
    if missing or unexpected:
        raise ValueError(
            f"weights do not map onto transformers: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    _materialise_buffers(hf, hf_cfg, device)
    if config.tie_word_embeddings:
        hf.tie_weights()
    if config.architecture == "gpt_oss":
        for layer in hf.model.layers:
            layer.mlp.experts.alpha = config.swiglu_alpha
            layer.mlp.experts.limit = config.swiglu_limit
    return hf.eval()


@torch.no_grad()
def hf_weights(model: DecoderModel) -> dict[str, torch.Tensor]:
    """The transformers state dict of `model`: views of its parameters, and copies where
    transformers' layout or dtype differs (gpt-oss's experts; its float32 attention sinks
    in a half-precision model)."""
    names = model.hf_weight_views()
    weights = {name: tensor for name, tensor in names.items() if ".mlp.experts." not in name}
    if model.config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}."
        sinks = weights.get(prefix + "self_attn.sinks")
        if sinks is not None and sinks.dtype != model.dtype:
            weights[prefix + "self_attn.sinks"] = sinks.to(model.dtype)
        if isinstance(layer.mlp, SparseMoE):
            experts = _gpt_oss_experts if model.config.architecture == "gpt_oss" else _qwen3_experts
            for name, tensor in experts(layer.mlp).items():
                weights[f"{prefix}mlp.experts.{name}"] = tensor
    return weights


def _qwen3_experts(moe: SparseMoE) -> dict[str, torch.Tensor]:
    w13, w2 = moe.w13, moe.w2  # [E, 2I, H] as [gate; up] rows, [E, H, I]: transformers' own
    assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    return {"gate_up_proj": w13.data, "down_proj": w2.data}


def _gpt_oss_experts(moe: SparseMoE) -> dict[str, torch.Tensor]:
    """transformers' gate_up_proj [E, H, 2I] (gate, up columns interleaved) and its bias
    [E, 2I], down_proj [E, I, H] (x @ w) and its bias [E, H]."""
    assert moe.w13_bias is not None and moe.w2_bias is not None
    num_experts, width = moe.w13_bias.shape[0], moe.width
    hidden = moe.w2_bias.shape[1]
    gate_up = torch.empty(num_experts, hidden, width, 2, dtype=moe.dtype, device=moe.device)
    # one expert at a time, so that dequantizing never holds more than one expert's temporaries
    for expert in range(num_experts):
        w13 = _expert_weight(moe.w13, expert, moe.dtype)  # [2I, H]: [gate; up] rows
        gate_up[expert].copy_(w13.view(2, width, hidden).permute(2, 1, 0))
    down = moe.w2  # [E, H, I]
    if not isinstance(down, torch.Tensor):
        down = _dequantized(down, moe.dtype)
    gate_up_bias = moe.w13_bias.data.view(num_experts, 2, width).transpose(1, 2)
    return {
        "gate_up_proj": gate_up.flatten(-2),
        "gate_up_proj_bias": gate_up_bias.reshape(num_experts, 2 * width),
        "down_proj": down.transpose(1, 2),
        "down_proj_bias": moe.w2_bias.data,
    }


def _expert_weight(
    weight: torch.Tensor | MXFP4Tensor | Fp8Experts, expert: int, dtype: torch.dtype
) -> torch.Tensor:  # [rows, cols] of one expert in `dtype`
    if isinstance(weight, MXFP4Tensor):
        return dequantize_mxfp4(weight[expert], dtype)
    if isinstance(weight, Fp8Experts):  # --mxfp4-copy fp8, which replaced the MXFP4 experts
        return dequantize_fp8_experts(weight.expert(expert), dtype)[0]
    return weight[expert]


def _dequantized(packed: MXFP4Tensor | Fp8Experts, dtype: torch.dtype) -> torch.Tensor:
    """[E, rows, cols] in `dtype`, dequantized one expert at a time."""
    out = torch.empty(packed.shape, dtype=dtype, device=packed.device)
    for expert in range(out.shape[0]):
        out[expert].copy_(_expert_weight(packed, expert, dtype))
    return out


def _attention_implementation(config: ModelConfig, requested: str | None) -> str:
    if not config.attention_sinks:
        return requested or "sdpa"
    if requested is None:
        return "eager"
    if requested not in SINK_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"{config.name or config.architecture} has attention sinks, which transformers' "
            f"{requested!r} attention ignores; use one of "
            + ", ".join(SINK_ATTENTION_IMPLEMENTATIONS)
        )
    return requested


def _check_room(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    if device.type != "cuda" or hf_own_weight_bytes(config, dtype.itemsize) == 0:
        return
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    # blocks that torch's allocator holds but no tensor uses are free for the copy too
    free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    problem = hf_room_problem(config, dtype, free_bytes, total_bytes)
    if problem:
        raise ValueError(problem)


def _materialise_buffers(hf: Any, hf_cfg: Any, device: torch.device) -> None:
    """Rebuild the (non-persistent) rotary buffers, which the meta build left empty."""
    rotary = hf.model.rotary_emb
    with torch.device(device):  # its constructor's signature differs across versions
        hf.model.rotary_emb = type(rotary)(hf_cfg)
    for name, buffer in hf.named_buffers():
        if buffer.is_meta:
            raise ValueError(f"transformers buffer {name} was not materialised")
