"""Tiny FP8 checkpoints in each format tandem reads, and the plain float32 checkpoint of the
same weights dequantized, for loader and engine tests.

The quantization here is written from the formats' descriptions, independently of the
code under test: block-wise `weight_scale_inv` (quant_method "fp8", 128x128 blocks, shapes
that are not multiples of 128), per-tensor `weight_scale` (quant_method "fp8" without
blocks, and compressed-tensors "tensor"), per-channel `weight_scale` [N, 1]
(compressed-tensors "channel"), static `input_scale`, and ignore lists (exact names and
"re:" patterns), and a Qwen3-MoE whose experts are FP8 too, one module per expert with
its own block scales as Qwen3-30B-A3B-FP8 stores them (its routers left unquantized).
Unquantized tensors are stored in bfloat16, as real FP8 checkpoints store them; the
reference holds them upcast to float32 (exactly).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.gpu._tiny_hf_models import seeded_model

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# hidden 192 and intermediate 288 are not multiples of 128: partial blocks in both axes.
FP8_TINY_SIZES: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=192,
    intermediate_size=288,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.15,
)
# Qwen3-MoE: layer 0 dense, layer 1 sparse; experts 160 wide, so that each of w13's halves
# ends in a partial 128-row block and the up half starts inside the fused rows' second.
FP8_TINY_MOE_SIZES: dict[str, Any] = dict(
    moe_intermediate_size=160,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],
)


@dataclass(frozen=True)
class Fp8Format:
    name: str
    architecture: str
    quantization_config: dict[str, Any]
    strategy: str
    """"block", "tensor" or "channel"."""
    static_input: bool = False
    ignore: tuple[str, ...] = ()
    scalar_scale: bool = False
    """Per-tensor scales stored 0-d (vLLM's fp8 serialization) rather than [1]."""


def _compressed_tensors(strategy: str, static_input: bool, ignore: list[str]) -> dict[str, Any]:
    inputs = (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        if static_input
        else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "dynamic": False,
                    "symmetric": True,
                },
                "input_activations": inputs,
            }
        },
        "ignore": ignore,
    }


LAYER1_MLP = r"re:model[.]layers[.]1[.]mlp[.].*"
FORMATS = {
    f.name: f
    for f in (
        Fp8Format(
            "fp8_block",
            "qwen3",
            {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK],
                "modules_to_not_convert": ["lm_head"],
            },
            "block",
            ignore=("lm_head",),
        ),
        Fp8Format(
            "fp8_tensor_static",
            "qwen2",
            {"quant_method": "fp8", "activation_scheme": "static"},
            "tensor",
            static_input=True,
            scalar_scale=True,
        ),
        Fp8Format(
            "ct_tensor",
            "llama",
            _compressed_tensors("tensor", False, ["lm_head"]),
            "tensor",
            ignore=("lm_head",),
        ),
        Fp8Format(
            "ct_channel",
            "llama",
            _compressed_tensors("channel", False, ["lm_head"]),
            "channel",
            ignore=("lm_head",),
        ),
        Fp8Format(
            "ct_static",
            "qwen2",
            _compressed_tensors("tensor", True, ["lm_head"]),
            "tensor",
            static_input=True,
            ignore=("lm_head",),
        ),
        Fp8Format(
            "fp8_block_moe",
            "qwen3_moe",
            {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK],
                "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.gate"],
            },
            "block",
            ignore=("lm_head", "model.layers.1.mlp.gate"),
        ),
        # A quantized LM head (dequantized at load) and an unquantized layer-1 MLP.
        Fp8Format(
            "ct_regex_ignore",
            "llama",
            _compressed_tensors("channel", False, [LAYER1_MLP]),
            "channel",
            ignore=(LAYER1_MLP,),
        ),
    )
}


def build_fp8_tiny_model(architecture: str, seed: int = 0, **sizes: Any) -> Any:
    """A transformers float32 model of FP8_TINY_SIZES (updated by `sizes`)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[architecture]
    tied = {"tie_word_embeddings": architecture == "qwen3"}
    moe = FP8_TINY_MOE_SIZES if architecture == "qwen3_moe" else {}
    return seeded_model(model_cls, config_cls(**{**FP8_TINY_SIZES, **tied, **moe, **sizes}), seed)


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], weight_scale_inv [ceil(N/128), ceil(K/128)], dequantized float32)."""
    rows, cols = w.shape
    row_blocks, col_blocks = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(row_blocks * BLOCK, col_blocks * BLOCK)
    padded[:rows, :cols] = w.float()
    amax = padded.view(row_blocks, BLOCK, col_blocks, BLOCK).abs().amax(dim=(1, 3))
    scale = amax.clamp(min=1e-12) / FP8_MAX
    per_value = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    w_fp8 = (w.float() / per_value).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w_fp8, scale, w_fp8.float() * per_value


def quantize_rows(
    w: torch.Tensor, per_channel: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], scale [N, 1] or [1], dequantized float32)."""
    amax = w.float().abs().amax(dim=1, keepdim=True) if per_channel else w.float().abs().amax()
    scale = amax.clamp(min=1e-12).reshape(-1, 1) / FP8_MAX  # [N, 1] or [1, 1]
    w_fp8 = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    scale = scale if per_channel else scale.reshape(1)
    return w_fp8, scale, w_fp8.float() * scale.reshape(-1, 1)


def is_ignored(module: str, ignore: tuple[str, ...]) -> bool:
    for entry in ignore:
        if entry.startswith("re:") and re.match(entry[3:], module):
            return True
        if module == entry or module.endswith("." + entry):
            return True
    return False


def quantized_state(
    state: dict[str, torch.Tensor], fmt: Fp8Format, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the FP8 checkpoint's tensors, the same weights dequantized in float32)."""
    generator = torch.Generator().manual_seed(seed)
    fp8: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        quantize = name.endswith(".weight") and (
            module.split(".")[-1] in PROJECTIONS or module == "lm_head"
        )
        if not quantize or is_ignored(module, fmt.ignore):
            fp8[name] = tensor.to(torch.bfloat16).contiguous()
            plain[name] = fp8[name].float()
            continue
        if fmt.strategy == "block":
            w_fp8, scale, dequantized = quantize_block(tensor)
            fp8[module + ".weight_scale_inv"] = scale
        else:
            w_fp8, scale, dequantized = quantize_rows(tensor, fmt.strategy == "channel")
            fp8[module + ".weight_scale"] = scale.reshape(()) if fmt.scalar_scale else scale
        fp8[name], plain[name] = w_fp8, dequantized
        if fmt.static_input:  # any calibrated value: CPU serving never quantizes activations
            input_scale = 0.01 + 0.05 * torch.rand(1, generator=generator)
            fp8[module + ".input_scale"] = (
                input_scale.reshape(()) if fmt.scalar_scale else input_scale
            )
    return fp8, plain


def write_fp8_checkpoint(model: Any, fmt: Fp8Format, fp8_dir: Path, plain_dir: Path) -> None:
    """Save `model` quantized in `fmt` to fp8_dir, and its dequantized weights as a plain
    float32 checkpoint to plain_dir (same config.json without quantization_config)."""
    state = _checkpoint_tensors(model)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fp8, plain = quantized_state(state, fmt)
    config = model.config.to_dict()
    for directory, tensors, quant in (
        (fp8_dir, fp8, fmt.quantization_config),
        (plain_dir, plain, None),
    ):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "model.safetensors"))
        with open(directory / "config.json", "w", encoding="utf-8") as f:
            json.dump({**config, "quantization_config": quant} if quant else config, f)


def _checkpoint_tensors(model: Any) -> dict[str, torch.Tensor]:
    """`model`'s tensors under the checkpoint's names: transformers' MoE modules hold the
    experts stacked, which save_pretrained writes one module per expert, as checkpoints do."""
    if model.config.model_type != "qwen3_moe":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return load_file(Path(directory) / "model.safetensors")
