"""The FP8 format of a Hugging Face checkpoint, read from config.json's `quantization_config`.

Two families of FP8 checkpoints are read (every other `quant_method` is refused in one
line, never loaded wrongly):

- `quant_method: "fp8"` (Qwen3-*-FP8, DeepSeek, transformers' FineGrainedFP8): with
  `weight_block_size: [128, 128]`, each projection holds `weight` (float8_e4m3fn [N, K])
  and `weight_scale_inv` (float32 [ceil(N/128), ceil(K/128)], multiplied in to
  dequantize); without it, one `weight_scale` per tensor (vLLM's serialized FP8), plus an
  `input_scale` when `activation_scheme` is "static". `modules_to_not_convert` lists the
  modules kept unquantized.
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (RedHatAI /
  neuralmagic): `weight_scale` per tensor ([1]) or per output channel ([N, 1]), a static
  `input_scale` ([1]) when `input_activations.dynamic` is false, and an `ignore` list
  whose entries are module names or "re:<regex>" patterns.

gpt-oss's MXFP4 experts are not FP8: config.py reads them (`mxfp4_experts`). A GGUF
file's 4-bit projections (Q4_0, Q4_1) are described by `Int4Checkpoint`, which the GGUF
loader reads from the file's tensor types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

FP8_BLOCK_SIZE = 128
"""Rows and columns of one weight block of block-wise FP8 checkpoints (the only size read)."""
WeightStrategy = Literal["block", "tensor", "channel"]
_FLOAT_QUANTIZED = "float-quantized"
_FP8_METHODS = ("fp8", "compressed-tensors")


class UnsupportedQuantizationError(ValueError):
    """The checkpoint is quantized in a way tandem cannot run; the message says why."""


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    """How a checkpoint stores its FP8 projections."""

    method: str
    """quant_method: "fp8" or "compressed-tensors"."""
    strategy: WeightStrategy
    """Weight scales: one per 128x128 block, per tensor, or per output channel."""
    static_input_scale: bool
    """Each quantized module carries a calibrated per-tensor `input_scale` ([1]);
    otherwise activations are quantized dynamically."""
    ignore: tuple[str, ...] = ()
    """Modules left unquantized: dotted names, or "re:<regex>" (compressed-tensors)."""

    @property
    def scale_suffix(self) -> str:
        """The weight scale's tensor name after the module's: block-wise FP8 checkpoints
        store the multiplier under `weight_scale_inv` (sic: it multiplies)."""
        is_block_fp8 = self.method == "fp8" and self.strategy == "block"
        return "weight_scale_inv" if is_block_fp8 else "weight_scale"

    def is_quantized(self, module: str) -> bool:
        """Whether the checkpoint stores `module` (e.g. "model.layers.0.self_attn.q_proj")
        in FP8, by its ignore list. The precision plan relies on it for the projections;
        the loader then checks each tensor's dtype against the plan."""
        return not any(_matches(entry, module) for entry in self.ignore)


@dataclass(frozen=True, slots=True)
class Int4Checkpoint:
    """The projections a GGUF file stores as 4-bit codes in blocks of 32 columns (Q4_0,
    Q4_1): gpu/models/precision.py may keep them packed (kernels/packed_cpu.py)."""

    modules: frozenset[str]
    """Checkpoint modules ("model.layers.0.self_attn.q_proj") stored in Q4_0 or Q4_1."""
    block_types: tuple[str, ...]
    """The GGUF types among them, sorted ("Q4_1",)."""

    def is_quantized(self, module: str) -> bool:
        return module in self.modules


def fp8_checkpoint(hf: dict[str, Any]) -> Fp8Checkpoint | None:
    """The FP8 format of a config.json dict: None when it has no `quantization_config`
    (or gpt-oss's MXFP4, which config.py handles). Raises UnsupportedQuantizationError
    for every other method or FP8 variant."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise UnsupportedQuantizationError("quantization_config must be a JSON object")
    method = quant.get("quant_method")
    if method == "mxfp4":
        if hf.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in (
            hf.get("architectures") or []
        ):
            return None
        raise UnsupportedQuantizationError(
            "MXFP4 (quant_method 'mxfp4') is read for gpt-oss experts only"
        )
    if method == "fp8":
        return _fp8_method(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise UnsupportedQuantizationError(
        f"unsupported quantization {method!r}; supported: fp8 (block 128x128 or per-tensor), "
        f"compressed-tensors float-quantized (per-tensor or per-channel), mxfp4 (gpt-oss "
        f"experts), or an unquantized checkpoint"
    )


def _fp8_method(quant: dict[str, Any]) -> Fp8Checkpoint:
    if quant.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedQuantizationError(
            f"unsupported fp8 format {quant.get('fmt')!r}; supported: e4m3"
        )
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise UnsupportedQuantizationError(f"unsupported fp8 activation_scheme {scheme!r}")
    block = quant.get("weight_block_size")
    ignore = tuple(quant.get("modules_to_not_convert") or ())
    if block is None:
        return Fp8Checkpoint("fp8", "tensor", scheme == "static", ignore)
    if list(block) != [FP8_BLOCK_SIZE, FP8_BLOCK_SIZE]:
        raise UnsupportedQuantizationError(
            f"unsupported fp8 weight_block_size {list(block)}; supported: [128, 128]"
        )
    if scheme == "static":
        raise UnsupportedQuantizationError(
            "block-wise fp8 with a static activation_scheme is not supported (dynamic only)"
        )
    return Fp8Checkpoint("fp8", "block", False, ignore)


def _compressed_tensors(quant: dict[str, Any]) -> Fp8Checkpoint:
    groups = list((quant.get("config_groups") or {}).values())
    # "mixed-precision" names each group's format; every one must be FP8 here.
    formats = {group.get("format") or quant.get("format") for group in groups}
    if quant.get("format") not in (_FLOAT_QUANTIZED, "mixed-precision") or formats != {
        _FLOAT_QUANTIZED
    }:
        raise UnsupportedQuantizationError(
            f"unsupported compressed-tensors format {quant.get('format')!r}; supported: "
            f"{_FLOAT_QUANTIZED} (FP8 weights)"
        )
    sparsity = (quant.get("sparsity_config") or {}).get("format")
    if sparsity not in (None, "dense"):
        raise UnsupportedQuantizationError(
            f"compressed-tensors sparsity format {sparsity!r} is not supported"
        )
    # kv_cache_scheme's k_scale / v_scale tensors are the KV cache's business
    # (--kv-cache-dtype), not the projections'.
    schemes = {_group_scheme(group) for group in groups}
    if len(schemes) != 1:
        raise UnsupportedQuantizationError(
            f"compressed-tensors needs exactly one quantization scheme, got {len(schemes)}"
        )
    strategy, static_input = schemes.pop()
    return Fp8Checkpoint(
        "compressed-tensors", strategy, static_input, tuple(quant.get("ignore") or ())
    )


def _group_scheme(group: dict[str, Any]) -> tuple[WeightStrategy, bool]:
    targets = group.get("targets") or ["Linear"]
    if list(targets) != ["Linear"]:
        raise UnsupportedQuantizationError(
            f"compressed-tensors targets {list(targets)} are not supported; supported: ['Linear']"
        )
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise UnsupportedQuantizationError(
            f"compressed-tensors weights of type {weights.get('type')!r} and "
            f"{weights.get('num_bits')} bits are not supported; supported: float, 8 bits (FP8)"
        )
    strategy = weights.get("strategy")
    if (
        strategy not in ("tensor", "channel")
        or weights.get("dynamic")
        or not weights.get("symmetric", True)
    ):
        raise UnsupportedQuantizationError(
            f"compressed-tensors weight strategy {strategy!r} is not supported; supported: "
            "static symmetric 'tensor' or 'channel'"
        )
    inputs = group.get("input_activations")
    if inputs is None:  # weight-only FP8: activations are quantized per token at run time
        return strategy, False
    if inputs.get("type", "float") != "float" or inputs.get("num_bits", 8) != 8:
        raise UnsupportedQuantizationError("compressed-tensors activations must be FP8")
    if inputs.get("dynamic"):
        return strategy, False
    if inputs.get("strategy", "tensor") != "tensor":
        raise UnsupportedQuantizationError(
            f"static compressed-tensors activations must be per tensor, got "
            f"{inputs.get('strategy')!r}"
        )
    return strategy, True


def _matches(entry: str, module: str) -> bool:
    """compressed-tensors' "re:" entries match from the start of the module name; other
    entries match whole dotted components ("lm_head", "model.layers.0.mlp",
    "self_attn.q_proj"), as modules_to_not_convert lists them."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return f".{entry}." in f".{module}."
