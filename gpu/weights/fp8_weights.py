"""FP8 checkpoint tensors into the form the model loads, as gpu/models/precision.py says.

A loader reads FP8 weights as float8_e4m3fn and their scales as float32, everything else
in the model dtype (`to_load_dtype`); `apply_precision` then, per checkpoint module:
- FP8 projection that runs FP8: keeps the e4m3 weight; a per-tensor or per-channel scale
  becomes `weight_scale` [N] (a per-tensor scale repeated: the product is the same, and
  fused parts with different scales then share one GEMM), a block scale stays
  `weight_scale_inv` [ceil(N/128), ceil(K/128)], a static `input_scale` becomes [1], the
  largest of the fused parts' (a larger scale cannot overflow any part);
- FP8 MoE expert that runs FP8 (`WeightPrecision.experts`, Qwen3-MoE's per-expert
  modules): the same, but weight-only, so any `input_scale` is dropped;
- any other FP8 tensor (CPU, --quantization none, experts that run in the model dtype, an
  ignored-but-quantized head): dequantized to the model dtype, its scales dropped;
- --quantization fp8: each projection weight, and each expert's where the experts run
  FP8, quantized per output channel.
`fp8_expected_shapes` adds the scale tensors to the names and shapes the loaders check.
Int4 projections (CPU) are then brought into their form by gpu/weights/int4_weights.py.
"""

from __future__ import annotations

import torch

from gpu.models.config import ModelConfig
from gpu.models.fp8_linear import BLOCK_SCALE_SUFFIX, INPUT_SCALE_SUFFIX, WEIGHT_SCALE_SUFFIX
from gpu.models.precision import (
    Fp8Scheme,
    WeightPrecision,
    group_of,
    is_expert_module,
    part_modules,
    resolve_precision,
)
from gpu.models.quant_config import FP8_BLOCK_SIZE, Fp8Checkpoint, Int4Checkpoint
from gpu.weights.int4_weights import apply_int4_precision
from gpu.weights.shard_layout import WHOLE_TENSOR, ShardSlice
from kernels._triton import HAS_TRITON
from kernels.fp8_quant import (
    FP8_DTYPE,
    dequantize_blockwise,
    dequantize_per_channel,
    quantize_weight_per_channel,
)

SCALE_SUFFIXES = (BLOCK_SCALE_SUFFIX, WEIGHT_SCALE_SUFFIX, INPUT_SCALE_SUFFIX)
_BLOCK = (FP8_BLOCK_SIZE, FP8_BLOCK_SIZE)


def device_precision(
    config: ModelConfig,
    requested: str,
    dtype: torch.dtype,
    device: str | torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    int4_checkpoint: Int4Checkpoint | None = None,
) -> WeightPrecision:
    """`resolve_precision` for `device`, its compute capability probed."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return resolve_precision(
        config,
        requested,
        dtype,
        device.type,
        capability,
        HAS_TRITON,
        tp_rank,
        tp_size,
        int4_checkpoint,
    )


def is_scale_name(name: str) -> bool:
    """FP8 scales, the KV cache's k_scale / v_scale among them: kept in float32."""
    return name.rsplit(".", 1)[-1] in (*SCALE_SUFFIXES, "k_scale", "v_scale")


def to_load_dtype(tensor: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as `apply_precision` takes it: e4m3 weights as they are, FP8
    scales in float32, every other floating tensor in `dtype`."""
    if tensor.dtype == FP8_DTYPE:
        return tensor
    return tensor.to(torch.float32 if is_scale_name(name) else dtype)


def fp8_scale_slices(
    checkpoint: Fp8Checkpoint, weight_slices: dict[str, ShardSlice]
) -> dict[str, ShardSlice]:
    """The slices of each projection's scales that a tensor-parallel rank reads, from its
    weight's slice: per-channel scales [N] / [N, 1] with the rows of a column-parallel
    weight (whole for a row-parallel one), block scales by the blocks of the weight's
    slice (precision.py refuses slices that cut a block), per-tensor scales whole."""
    slices: dict[str, ShardSlice] = {}
    for name, shard in weight_slices.items():
        if not name.endswith(".weight") or shard.dim is None:
            continue
        module = name.removesuffix(".weight")
        scale_name = f"{module}.{checkpoint.scale_suffix}"
        if checkpoint.strategy == "block":
            start, stop = shard.start // FP8_BLOCK_SIZE, -(-shard.stop // FP8_BLOCK_SIZE)
            slices[scale_name] = ShardSlice(shard.dim, start, stop, stop - start)
        elif checkpoint.strategy == "channel" and shard.dim == 0:
            slices[scale_name] = shard
        else:
            slices[scale_name] = WHOLE_TENSOR
    return slices


def apply_precision(weights: dict[str, torch.Tensor], precision: WeightPrecision) -> None:
    """Bring `weights` (read with `to_load_dtype`) into the form `precision` says, in
    place (see the module docstring), int4 projections last. Raises ValueError naming a
    tensor that does not match the checkpoint's quantization_config."""
    for name in [n for n, t in weights.items() if t.dtype == FP8_DTYPE]:
        module = name.removesuffix(".weight")
        checkpoint = precision.checkpoint
        if checkpoint is None or not name.endswith(".weight"):
            raise ValueError(
                f"float8 tensor {name!r} in a checkpoint without an fp8 quantization_config"
            )
        group = group_of(module)
        scheme = None if group is None else precision.fp8_schemes.get(group)
        if scheme is None and is_expert_module(module):
            scheme = precision.experts
            weights.pop(f"{module}.{INPUT_SCALE_SUFFIX}", None)  # weight-only: never used
        if scheme is None:
            weights[name] = _dequantized(weights, module, checkpoint, precision.dtype)
        else:
            _keep_fp8(weights, module, checkpoint, scheme)
    for group, scheme in precision.fp8_schemes.items():
        modules = part_modules(group)
        if scheme.quantized_at_load:
            for module in modules:
                _quantize_at_load(weights, module)
        for module in modules:
            if module + ".weight" in weights and weights[module + ".weight"].dtype != FP8_DTYPE:
                raise ValueError(
                    f"{module}.weight is {weights[module + '.weight'].dtype}, but "
                    "quantization_config says the module is fp8"
                )
        if scheme.static_input_scale:
            _share_input_scale(weights, modules)
    if precision.experts is not None:
        _fp8_expert_weights(weights, precision.experts)
    apply_int4_precision(weights, precision)


def _fp8_expert_weights(weights: dict[str, torch.Tensor], scheme: Fp8Scheme) -> None:
    """Quantize each expert's weight at load (--quantization fp8), or check that the
    checkpoint's are all FP8, as its quantization_config says."""
    for name, module in [(n, _expert_weight_module(n)) for n in weights]:
        if module is None:
            continue
        if scheme.quantized_at_load:
            _quantize_at_load(weights, module)
        elif weights[name].dtype != FP8_DTYPE:
            raise ValueError(
                f"{name} is {weights[name].dtype}, but quantization_config says the module is fp8"
            )


def _expert_weight_module(name: str) -> str | None:
    """The expert module of an expert's `.weight` name; None for any other name."""
    module = name.removesuffix(".weight")
    return module if module != name and is_expert_module(module) else None


def fp8_expected_shapes(
    expected: dict[str, tuple[int, ...]], precision: WeightPrecision
) -> dict[str, tuple[int, ...]]:
    """`expected` (name -> shape of this rank's weights) plus the scales of the FP8
    projections and experts."""
    shapes = dict(expected)
    modules = [(m, scheme) for g, scheme in precision.fp8_schemes.items() for m in part_modules(g)]
    if precision.experts is not None:
        expert_modules = filter(None, map(_expert_weight_module, expected))
        modules += [(module, precision.experts) for module in expert_modules]
    for module, scheme in modules:
        rows, cols = expected[module + ".weight"]
        if scheme.block:
            blocks = (-(-rows // FP8_BLOCK_SIZE), -(-cols // FP8_BLOCK_SIZE))
            shapes[f"{module}.{BLOCK_SCALE_SUFFIX}"] = blocks
        else:
            shapes[f"{module}.{WEIGHT_SCALE_SUFFIX}"] = (rows,)
        if scheme.static_input_scale:
            shapes[f"{module}.{INPUT_SCALE_SUFFIX}"] = (1,)
    return shapes


def _dequantized(
    weights: dict[str, torch.Tensor], module: str, checkpoint: Fp8Checkpoint, dtype: torch.dtype
) -> torch.Tensor:  # [N, K] dtype
    weights.pop(f"{module}.{INPUT_SCALE_SUFFIX}", None)  # activations stay unquantized
    weight = weights[module + ".weight"]
    scale = _pop_scale(weights, module, checkpoint.scale_suffix)
    if checkpoint.strategy == "block":
        return dequantize_blockwise(weight, scale, _BLOCK, dtype)
    return dequantize_per_channel(weight, scale.reshape(-1), dtype)


def _keep_fp8(
    weights: dict[str, torch.Tensor], module: str, checkpoint: Fp8Checkpoint, scheme: Fp8Scheme
) -> None:
    rows = weights[module + ".weight"].shape[0]
    scale = _pop_scale(weights, module, checkpoint.scale_suffix)
    if scheme.block:
        weights[f"{module}.{BLOCK_SCALE_SUFFIX}"] = scale.contiguous()
    elif scale.numel() == 1:  # per tensor -> per channel
        weights[f"{module}.{WEIGHT_SCALE_SUFFIX}"] = scale.reshape(1).expand(rows).contiguous()
    else:
        weights[f"{module}.{WEIGHT_SCALE_SUFFIX}"] = scale.reshape(rows).contiguous()
    if scheme.static_input_scale:
        weights[f"{module}.{INPUT_SCALE_SUFFIX}"] = _pop_scale(
            weights, module, INPUT_SCALE_SUFFIX
        ).reshape(1)


def _quantize_at_load(weights: dict[str, torch.Tensor], module: str) -> None:
    weight_fp8, scale = quantize_weight_per_channel(weights[module + ".weight"])
    weights[module + ".weight"] = weight_fp8
    weights[f"{module}.{WEIGHT_SCALE_SUFFIX}"] = scale


def _share_input_scale(weights: dict[str, torch.Tensor], modules: list[str]) -> None:
    """One activation scale for fused parts: the largest, so that no part's input clips."""
    names = [f"{module}.{INPUT_SCALE_SUFFIX}" for module in modules]
    present = [weights[name] for name in names if name in weights]
    if len(present) == len(names):
        shared = torch.stack(present).amax(dim=0)
        for name in names:
            weights[name] = shared.clone()


def _pop_scale(weights: dict[str, torch.Tensor], module: str, suffix: str) -> torch.Tensor:
    name = f"{module}.{suffix}"
    if name not in weights:
        raise ValueError(f"missing weight {name!r} for the float8 {module}.weight")
    return weights.pop(name).float()
