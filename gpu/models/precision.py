"""What precision each projection runs in: the one place that decides it.

Inputs: the checkpoint's FP8 format (`ModelConfig.fp8`, gpu/models/quant_config.py), a GGUF
file's 4-bit projections (`Int4Checkpoint`), --quantization (auto: what the checkpoint
holds; fp8: quantize a bf16 checkpoint per output channel at load; int4: packed int4 on
the CPU; none: dequantize everything), and the device. Output: a `WeightPrecision` naming
each fused projection (qkv, o, gate/up, down of each layer) that runs as an FP8 GEMM or as
a packed int4 GEMM, and how; every other weight is in the model dtype. The loaders
(gpu/weights/fp8_weights.py, int4_weights.py) shape the tensors and the model
(gpu/models/fp8_linear.py, int4_linear.py) allocates its projections from this record.

FP8 GEMMs run on CUDA devices of compute capability >= 8.9 only. On CPU an FP8 checkpoint
is dequantized at load (the correctness path); on an older GPU it is refused unless
--quantization none asks for the dequantized model. On one CPU device (no tensor
parallelism), auto keeps a GGUF's Q4_0 / Q4_1 projections packed as int4 (4 bits a weight
read per decode step instead of float32's 32); int4 also quantizes every other projection
at load. The LM head, embeddings, norms and MoE routers stay in the model dtype.

Qwen3-MoE experts run in FP8 on such GPUs (with Triton) where the checkpoint stores them in
FP8 (block scales, or per tensor / per channel, kept per output channel) or --quantization
fp8 asks (per output channel, quantized at load): weight-only, the activations unquantized
(`WeightPrecision.experts`, kernels/fused_moe.py). Elsewhere they are in the model dtype
(an FP8 checkpoint's dequantized at load); gpt-oss's MXFP4 experts stay MXFP4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from gpu.models.config import ModelConfig, UnsupportedModelError
from gpu.models.projection_groups import (  # noqa: F401 - re-exported for the model and loaders
    DOWN_GROUP,
    EXPERT_PROJECTIONS,
    GATE_UP_GROUP,
    GROUP_PARTS,
    O_GROUP,
    QKV_GROUP,
    PartSlice,
    block_aligned,
    group_of,
    is_expert_module,
    layer_geometry,
    local_name,
    part_modules,
)
from gpu.models.quant_config import Fp8Checkpoint, Int4Checkpoint

QUANTIZATIONS = ("auto", "fp8", "int4", "none")
"""--quantization's values (actors/protocol/config.py lists the same)."""
FP8_MIN_CAPABILITY = (8, 9)
"""Ada / Hopper and later: the first GPUs with FP8 tensor cores."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How one FP8 projection multiplies."""

    block: bool
    """Weight scales per 128x128 block [ceil(N/128), ceil(K/128)] and activations scaled
    per token per 128 columns; otherwise one weight scale per output channel [N] (per-tensor
    scales are expanded at load: the product is the same) and one activation scale per
    token."""
    static_input_scale: bool = False
    """A calibrated per-tensor activation scale ([1]; fused parts take the largest)."""
    quantized_at_load: bool = False
    """--quantization fp8: bf16 weights quantized per output channel when loaded."""

    def describe(self) -> str:
        if self.block:
            return "block 128x128, dynamic per-token-group activations"
        weights = "per-channel, quantized at load" if self.quantized_at_load else "per-channel"
        inputs = "static per-tensor" if self.static_input_scale else "dynamic per-token"
        return f"{weights}, {inputs} activations"


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """A packed int4 projection on the CPU (gpu/models/int4_linear.py): 4-bit codes in
    groups of 32 input columns with a bf16 scale and zero each, times bf16 activations."""

    block_types: str = ""
    """The GGUF blocks the codes come from ("Q4_1"); "" when quantized at load."""

    def describe(self) -> str:
        codes = f"from {self.block_types} blocks" if self.block_types else "quantized at load"
        return f"32-column groups {codes}, bf16 scales and activations"


ProjectionScheme = Fp8Scheme | Int4Scheme


@dataclass(frozen=True, slots=True)
class WeightPrecision:
    dtype: torch.dtype
    """The model dtype: every weight not listed in `schemes`, and the activations."""
    checkpoint: Fp8Checkpoint | None = None
    schemes: Mapping[str, ProjectionScheme] = field(default_factory=dict)
    """Fused projection ("model.layers.0.self_attn.qkv_proj") -> its FP8 or int4 scheme."""
    notes: tuple[str, ...] = ()
    """Why FP8 weights are dequantized where they are (logged at load)."""
    num_projections: int = 0
    """Checkpoint projections of the dense parts (q, k, v, o, gate, up, down per layer)."""
    experts: Fp8Scheme | None = None
    """The MoE experts' FP8 scheme (weight-only, kernels/fused_moe.py; per channel or per
    block, never a static input scale); None: the model dtype, or gpt-oss's MXFP4."""

    @property
    def fp8_schemes(self) -> dict[str, Fp8Scheme]:
        return {g: s for g, s in self.schemes.items() if isinstance(s, Fp8Scheme)}

    @property
    def int4_schemes(self) -> dict[str, Int4Scheme]:
        return {g: s for g, s in self.schemes.items() if isinstance(s, Int4Scheme)}

    @property
    def runs_fp8(self) -> bool:
        return bool(self.fp8_schemes) or self.experts is not None

    @property
    def runs_int4(self) -> bool:
        return bool(self.int4_schemes)

    @property
    def num_fp8_projections(self) -> int:
        return sum(len(GROUP_PARTS[local_name(g)]) for g in self.fp8_schemes)

    @property
    def num_int4_projections(self) -> int:
        return sum(len(GROUP_PARTS[local_name(g)]) for g in self.int4_schemes)

    def scheme(self, group: str) -> ProjectionScheme | None:
        return self.schemes.get(group)

    def layer_schemes(self, layer: int) -> dict[str, ProjectionScheme]:
        """Group name within layer `layer` -> scheme, for its FP8 and int4 projections."""
        prefix = f"model.layers.{layer}."
        return {g.removeprefix(prefix): s for g, s in self.schemes.items() if g.startswith(prefix)}

    def describe(self, config: ModelConfig) -> str:
        """One line: what runs in what precision."""
        dtype = _name(self.dtype)
        in_dtype = []
        num_plain = self.num_projections - self.num_fp8_projections - self.num_int4_projections
        if self.schemes and num_plain:
            in_dtype.append(f"{num_plain} projections")
        if config.is_moe and not config.mxfp4_experts and self.experts is None:
            in_dtype.append(
                "experts (dequantized from fp8)" if self.fp8_experts(config) else "experts"
            )
        if config.is_moe:
            in_dtype.append("routers")
        in_dtype += ["lm_head", "embeddings", "norms"]
        experts = ["mxfp4 for experts"] if config.mxfp4_experts else []
        if self.experts is not None:
            experts = [f"fp8 for experts ({_describe_experts(self.experts, dtype)})"]
        if not self.schemes and self.experts is None:
            origin = " (fp8 checkpoint dequantized at load)" if self.checkpoint else ""
            return "; ".join([f"weights: {dtype}{origin}", *experts])
        packed = []
        for kind, schemes, num in (
            ("fp8", self.fp8_schemes, self.num_fp8_projections),
            ("int4", self.int4_schemes, self.num_int4_projections),
        ):
            if schemes:
                described = "; ".join(sorted({s.describe() for s in schemes.values()}))
                packed.append(f"{kind} ({described}) for {num} projections")
        return "weights: " + "; ".join([*packed, f"{dtype} for {', '.join(in_dtype)}", *experts])

    def fp8_experts(self, config: ModelConfig) -> bool:
        """Whether the checkpoint stores its MoE experts in FP8 (run so where `experts` is
        set, dequantized at load otherwise)."""
        if not config.is_moe or self.checkpoint is None:
            return False
        first_moe = next(i for i in range(config.num_layers) if config.is_moe_layer(i))
        expert = f"model.layers.{first_moe}.mlp.experts.0.gate_proj"
        return self.checkpoint.is_quantized(expert)


def resolve_precision(
    config: ModelConfig,
    requested: str,
    dtype: torch.dtype,
    device_type: str,
    capability: tuple[int, int] | None = None,
    has_triton: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    int4_checkpoint: Int4Checkpoint | None = None,
) -> WeightPrecision:
    """Decide each projection's precision. Raises UnsupportedModelError for what cannot
    run: FP8 GEMMs off CUDA or below compute capability 8.9 (an FP8 checkpoint is
    dequantized on CPU, or anywhere with --quantization none), block-wise FP8 without
    Triton, block scales that a tensor-parallel rank's slice would cut, and int4 off a
    single CPU device. `int4_checkpoint`: a GGUF file's Q4_0 / Q4_1 projections."""
    if requested not in QUANTIZATIONS:
        raise UnsupportedModelError(
            f"--quantization must be auto, fp8, int4 or none, got {requested!r}"
        )
    checkpoint = config.fp8
    geometry = layer_geometry(config, tp_rank, tp_size)
    if checkpoint is not None and checkpoint.strategy == "block":
        _check_block_shards(config.name or config.architecture, geometry, tp_size)
    base = WeightPrecision(dtype, checkpoint, num_projections=_count_projections(config))
    on_one_cpu = device_type == "cpu" and tp_size == 1
    if requested == "int4" or (requested == "auto" and int4_checkpoint and on_one_cpu):
        return _int4_schemes(base, geometry, on_one_cpu, requested, int4_checkpoint)
    if checkpoint is None and requested != "fp8":
        return base
    if requested == "none":
        note = f"--quantization none: the fp8 checkpoint is dequantized to {_name(dtype)} at load"
        return dataclasses.replace(base, notes=(note,))
    if device_type != "cuda":
        if checkpoint is None:
            raise UnsupportedModelError(
                "--quantization fp8 runs FP8 GEMMs, which need a CUDA GPU of compute "
                "capability >= 8.9; on CPU serve the unquantized model (--quantization auto)"
            )
        note = f"CPU: fp8 weights are dequantized to {_name(dtype)} at load (no FP8 GEMMs)"
        return dataclasses.replace(base, notes=(note,))
    scheme = _fp8_scheme(checkpoint)
    _check_fp8_device(config, scheme, dtype, capability, has_triton)
    return _plan_experts(config, _fp8_schemes(base, geometry, scheme), has_triton)


def _plan_experts(
    config: ModelConfig, precision: WeightPrecision, has_triton: bool
) -> WeightPrecision:
    """Qwen3-MoE's experts in FP8 (weight-only, in the fused MoE's Triton GEMMs) where the
    checkpoint stores them in FP8 or --quantization fp8 asks; a note where they stay in the
    model dtype instead. Each MoE layer's first expert speaks for the layer (the loader
    refuses any expert tensor that contradicts the plan)."""
    if not config.is_moe or config.mxfp4_experts or config.architecture != "qwen3_moe":
        return _dequantized_experts_note(config, precision, "")
    checkpoint = precision.checkpoint
    layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    modules = [f"model.layers.{i}.mlp.experts.0.{p}" for i in layers for p in EXPERT_PROJECTIONS]
    quantized = [checkpoint is None or checkpoint.is_quantized(m) for m in modules]
    if not any(quantized):
        return precision
    if not all(quantized):
        return _dequantized_experts_note(config, precision, " (partly unquantized)")
    if not has_triton:
        return _dequantized_experts_note(config, precision, " (their FP8 kernel needs Triton)")
    block = checkpoint is not None and checkpoint.strategy == "block"
    return dataclasses.replace(
        precision, experts=Fp8Scheme(block, quantized_at_load=checkpoint is None)
    )


def _dequantized_experts_note(
    config: ModelConfig, precision: WeightPrecision, why: str
) -> WeightPrecision:
    """`precision` with a note saying that the checkpoint's FP8 experts run dequantized."""
    if not precision.fp8_experts(config):
        return precision
    note = (
        f"MoE experts: fp8 in the checkpoint{why}, dequantized to {_name(precision.dtype)} at load"
    )
    return dataclasses.replace(precision, notes=(*precision.notes, note))


def _describe_experts(scheme: Fp8Scheme, dtype: str) -> str:
    scales = "block 128x128 scales" if scheme.block else "per-channel scales"
    if scheme.quantized_at_load:
        scales += ", quantized at load"
    return f"weight-only, {scales}, {dtype} activations"


def _fp8_scheme(checkpoint: Fp8Checkpoint | None) -> Fp8Scheme:
    if checkpoint is None:  # --quantization fp8
        return Fp8Scheme(block=False, quantized_at_load=True)
    return Fp8Scheme(checkpoint.strategy == "block", checkpoint.static_input_scale)


def _check_fp8_device(
    config: ModelConfig,
    scheme: Fp8Scheme,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    has_triton: bool,
) -> None:
    """Refuse FP8 GEMMs on a GPU below compute capability 8.9, and the block-scaled
    (Triton) GEMM without Triton, in one line that names the way out."""
    online = scheme.quantized_at_load
    what = "--quantization fp8" if online else f"the fp8 checkpoint {config.name or ''}".rstrip()
    fallback = "--quantization auto" if online else "--quantization none"
    if capability is None or tuple(capability) < FP8_MIN_CAPABILITY:
        raise UnsupportedModelError(
            f"{what} needs FP8 GEMMs, which need compute capability >= 8.9 (this GPU: "
            f"{_capability(capability)}); use {fallback} to run it in {_name(dtype)}"
        )
    if scheme.block and not has_triton:
        raise UnsupportedModelError(
            f"{what} is block-wise FP8, whose GEMM is a Triton kernel, and Triton is not "
            f"usable here; use {fallback} to run it in {_name(dtype)}"
        )


def _check_block_shards(
    name: str, geometry: list[dict[str, list[PartSlice]]], tp_size: int
) -> None:
    if tp_size == 1:
        return
    for group, parts in {g: p for groups in geometry for g, p in groups.items()}.items():
        if any(not block_aligned([part]) for part in parts):
            raise UnsupportedModelError(
                f"{name}: block-wise FP8 under tensor parallel size {tp_size} needs each "
                f"rank's slice of {group} to be whole 128-blocks; use a smaller "
                f"--tensor-parallel-size"
            )


def _fp8_schemes(
    base: WeightPrecision, geometry: list[dict[str, list[PartSlice]]], scheme: Fp8Scheme
) -> WeightPrecision:
    """`scheme` for every fused projection that can run it; the others (parts the
    checkpoint leaves unquantized, block-scaled parts that do not fuse on block
    boundaries) stay in the model dtype, with a note saying why."""
    schemes: dict[str, Fp8Scheme] = {}
    dequantized: dict[str, list[int]] = {}  # reason -> layers
    checkpoint = base.checkpoint
    for layer, groups in enumerate(geometry):
        for group, parts in groups.items():
            modules = [f"model.layers.{layer}.{p.module}" for p in parts]
            quantized = [checkpoint is None or checkpoint.is_quantized(m) for m in modules]
            reason = None
            if not all(quantized):
                reason = f"{group}: partly unquantized in the checkpoint" if any(quantized) else ""
            elif scheme.block and not block_aligned(parts):
                reason = f"{group}: fused parts are not whole 128-row blocks"
            if reason is None:
                schemes[f"model.layers.{layer}.{group}"] = scheme
            elif reason:
                dequantized.setdefault(reason, []).append(layer)
    notes = tuple(
        f"{reason} ({len(layers)} layers): runs dequantized to {_name(base.dtype)}"
        for reason, layers in dequantized.items()
    )
    return dataclasses.replace(base, schemes=schemes, notes=notes)


def _int4_schemes(
    base: WeightPrecision,
    geometry: list[dict[str, list[PartSlice]]],
    on_one_cpu: bool,
    requested: str,
    gguf: Int4Checkpoint | None,
) -> WeightPrecision:
    """Int4 for every fused projection whose parts the GGUF stores in Q4 blocks; under
    --quantization int4 for the others too (quantized at load; FP8 ones dequantized first)."""
    if not on_one_cpu:
        raise UnsupportedModelError(
            "--quantization int4 runs torch's CPU int4 GEMM, on one CPU device only "
            "(--device cpu, --tensor-parallel-size 1); use --quantization auto"
        )
    schemes: dict[str, ProjectionScheme] = {}
    for layer, groups in enumerate(geometry):
        for group, parts in groups.items():
            modules = [f"model.layers.{layer}.{p.module}" for p in parts]
            if gguf is not None and all(gguf.is_quantized(m) for m in modules):
                schemes[f"model.layers.{layer}.{group}"] = Int4Scheme("+".join(gguf.block_types))
            elif requested == "int4":
                schemes[f"model.layers.{layer}.{group}"] = Int4Scheme()
    return dataclasses.replace(base, schemes=schemes)


def _count_projections(config: ModelConfig) -> int:
    num_dense = config.num_layers - config.num_moe_layers
    return 4 * config.num_layers + 3 * num_dense


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _capability(capability: tuple[int, int] | None) -> str:
    return "none" if capability is None else f"{capability[0]}.{capability[1]}"
