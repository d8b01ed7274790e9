"""The sparse MLP block of Qwen3-MoE and gpt-oss: router -> top-k -> fused experts.

Expert weights are two stacked tensors per layer, in the layout kernels/fused_moe.py
multiplies with:

    w13: [num_experts, 2 * I, hidden]   rows [0, I) gate_proj, rows [I, 2I) up_proj
    w2:  [num_experts, hidden, I]

in the model dtype, or as MXFP4 (uint8 blocks and scales, never converted) when the
checkpoint ships them so (gpt-oss), or, where gpu/models/precision.py says (`experts`:
Qwen3-MoE on CUDA), as FP8 e4m3 with float32 scales `w13_scale` / `w2_scale`, per output
channel ([E, 2I], [E, hidden]) or per 128x128 block of each projection
([E, 2 * ceil(I/128), ceil(hidden/128)]: the gate's block rows, then the up's;
[E, ceil(hidden/128), ceil(I/128)]) (kernels/fp8_experts.py). Checkpoints store them
otherwise: Qwen3-MoE one tensor per expert and projection (FP8 ones with their
`weight_scale_inv` or `weight_scale`), gpt-oss gate and up rows interleaved (gate = rows
0::2, up = rows 1::2) and, as transformers saves it unquantized, transposed.
`moe_weight_targets` maps each checkpoint tensor onto a view of these parameters, so that
loading is one strided copy per tensor, with no temporary.

With --mxfp4-copy, MXFP4 experts also get a copy in bf16 or FP8
(gpu/models/mxfp4_copy.py), which steps of at least COPY_MIN_ROWS[kind] rows per expert
multiply with; a copy that serves every step (FP8) replaces them (`drop_mxfp4_experts`).

The stacked expert tensors are allocated when their weights arrive (`materialize`), not at
construction: a loader that frees each checkpoint tensor as it is copied then never holds
much more than one copy of the experts on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu.models.config import MXFP4_GROUP_SIZE, ModelConfig
from gpu.models.fp8_linear import BLOCK_SCALE_SUFFIX, WEIGHT_SCALE_SUFFIX
from gpu.models.layers import empty_parameter
from gpu.models.precision import Fp8Scheme
from kernels.fp8_experts import Fp8Experts, fp8_expert_scale_shapes
from kernels.fp8_quant import FP8_DTYPE
from kernels.fused_moe import GATED_PARTS, MoEActivation, fused_moe
from kernels.moe_routing import moe_route
from kernels.mxfp4 import MXFP4Tensor

MXFP4_BLOCK_BYTES = MXFP4_GROUP_SIZE // 2
COPY_MIN_ROWS = {"bf16": 64.0, "fp8": 0.0}
"""Mean grouped rows per expert from which a step multiplies with the MXFP4 experts' copy
of each kind (where there is one). One gpt-oss-20b layer on an H100 (benchmarks/NOTES.md):
MXFP4 0.56 ms against bf16's 0.62 at 32 rows per expert, 4.2 ms against 2.0 at 512; the
FP8 copy ran faster than MXFP4 at every count measured (72 against about 82 us at one
token, 0.49 against 0.56 ms at 32 rows per expert), so it serves every step."""
_META = torch.device("meta")


@dataclass(frozen=True)
class ViewTarget:
    """A load target whose checkpoint tensor, of `shape`, is copied through a reshape to
    `dest.shape` (`dest` being a strided view of a parameter)."""

    dest: torch.Tensor
    shape: torch.Size

    def copy_(self, source: torch.Tensor) -> None:
        self.dest.copy_(source.reshape(self.dest.shape))


class SparseMoE(nn.Module):
    """softmax router, top-k, and the sum of each token's experts weighted by their
    routing probability (renormalised over the top-k when `config.norm_topk_prob`).
    `fp8`: the experts' FP8 scheme (weight-only), None for the model dtype or MXFP4."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        fp8: Fp8Scheme | None = None,
    ) -> None:
        super().__init__()
        num_experts, hidden = config.num_experts, config.hidden_size
        self.width = config.moe_intermediate_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.is_mxfp4 = config.mxfp4_experts
        self.fp8 = fp8
        self.activation = MoEActivation(
            "silu" if config.moe_activation == "silu" else "swiglu_clamped",
            config.swiglu_alpha,
            config.swiglu_limit,
        )
        self.router = empty_parameter(num_experts, hidden, dtype=dtype, device=device)
        self.router_bias = (
            empty_parameter(num_experts, dtype=dtype, device=device) if config.router_bias else None
        )
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if config.expert_bias:
            self.w13_bias = empty_parameter(num_experts, 2 * self.width, dtype=dtype, device=device)
            self.w2_bias = empty_parameter(num_experts, hidden, dtype=dtype, device=device)
        for name, shape, param_dtype in self._expert_shapes(num_experts, hidden):
            self.register_parameter(name, empty_parameter(*shape, dtype=param_dtype, device=_META))
        self.expert_copy: tuple[torch.Tensor | Fp8Experts, torch.Tensor | Fp8Experts] | None = None
        """(w13, w2) of the MXFP4 experts' copy for steps of at least copy_min_rows rows
        per expert, where --mxfp4-copy made one (gpu/models/mxfp4_copy.py)."""
        self.copy_min_rows = 0.0
        self.mxfp4_dropped = False
        """True once drop_mxfp4_experts freed the MXFP4 experts for a copy."""

    def _expert_shapes(
        self, num_experts: int, hidden: int
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        two_width = 2 * self.width
        shape13, shape2 = (num_experts, two_width, hidden), (num_experts, hidden, self.width)
        if self.fp8 is not None:
            (channel13, block13), (channel2, block2) = (
                fp8_expert_scale_shapes(shape13, GATED_PARTS),
                fp8_expert_scale_shapes(shape2),
            )
            return [
                ("w13_weight", shape13, FP8_DTYPE),
                ("w13_scale", block13 if self.fp8.block else channel13, torch.float32),
                ("w2_weight", shape2, FP8_DTYPE),
                ("w2_scale", block2 if self.fp8.block else channel2, torch.float32),
            ]
        if not self.is_mxfp4:
            return [("w13_weight", shape13, self.dtype), ("w2_weight", shape2, self.dtype)]
        groups13, groups2 = hidden // MXFP4_GROUP_SIZE, self.width // MXFP4_GROUP_SIZE
        return [
            ("w13_blocks", (num_experts, two_width, groups13, MXFP4_BLOCK_BYTES), torch.uint8),
            ("w13_scales", (num_experts, two_width, groups13), torch.uint8),
            ("w2_blocks", (num_experts, hidden, groups2, MXFP4_BLOCK_BYTES), torch.uint8),
            ("w2_scales", (num_experts, hidden, groups2), torch.uint8),
        ]

    @property
    def is_materialized(self) -> bool:
        return all(not p.is_meta for p in self.parameters())

    def materialize(self) -> None:
        """Allocate the (uninitialised) stacked expert tensors on the model's device."""
        for name, param in list(self.named_parameters(recurse=False)):
            if param.is_meta:
                real = torch.empty(param.shape, dtype=param.dtype, device=self.device)
                self.register_parameter(name, nn.Parameter(real, requires_grad=False))

    def drop_mxfp4_experts(self) -> None:
        """Free the MXFP4 experts once a copy serves every step (copy_min_rows 0), so that
        their bytes go to the KV cache; w13 and w2 are the copy's from then on."""
        assert self.is_mxfp4 and self.expert_copy is not None and self.copy_min_rows == 0
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
            delattr(self, name)
        self.mxfp4_dropped = True

    @property
    def w13(self) -> torch.Tensor | MXFP4Tensor | Fp8Experts:  # [num_experts, 2 * width, hidden]
        if self.mxfp4_dropped:
            assert self.expert_copy is not None
            return self.expert_copy[0]
        if self.is_mxfp4:
            return MXFP4Tensor(self.w13_blocks, self.w13_scales)
        if self.fp8 is not None:
            return Fp8Experts(self.w13_weight, self.w13_scale)
        return self.w13_weight

    @property
    def w2(self) -> torch.Tensor | MXFP4Tensor | Fp8Experts:  # [num_experts, hidden, width]
        if self.mxfp4_dropped:
            assert self.expert_copy is not None
            return self.expert_copy[1]
        if self.is_mxfp4:
            return MXFP4Tensor(self.w2_blocks, self.w2_scales)
        if self.fp8 is not None:
            return Fp8Experts(self.w2_weight, self.w2_scale)
        return self.w2_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        router_logits = F.linear(x, self.router, self.router_bias)  # [num_tokens, num_experts]
        topk_weights, topk_ids = moe_route(router_logits, self.top_k, self.renormalize)
        # x's row count is fixed per captured graph, so the choice is too
        num_rows_per_expert = x.shape[0] * self.top_k / self.router.shape[0]
        if self.expert_copy is not None and num_rows_per_expert >= self.copy_min_rows:
            w13, w2 = self.expert_copy
        else:
            w13, w2 = self.w13, self.w2
        return fused_moe(
            x, topk_weights, topk_ids, w13, w2, self.w13_bias, self.w2_bias, self.activation
        )


def moe_weight_targets(
    prefix: str, moe: SparseMoE, config: ModelConfig
) -> dict[str, torch.Tensor | ViewTarget]:
    """Checkpoint tensor name -> where it is copied, for the MLP of the layer at `prefix`
    ("model.layers.{i}."); the layouts are gpu/weights/layout.py's."""
    if config.architecture == "qwen3_moe":
        return _qwen3_moe_targets(prefix + "mlp.", moe)
    return _gpt_oss_targets(prefix + "mlp.", moe)


def _qwen3_moe_targets(prefix: str, moe: SparseMoE) -> dict[str, torch.Tensor | ViewTarget]:
    targets: dict[str, torch.Tensor | ViewTarget] = {f"{prefix}gate.weight": moe.router.data}
    w13, w2 = moe.w13_weight.data, moe.w2_weight.data
    for expert in range(w13.shape[0]):
        name = f"{prefix}experts.{expert}."
        targets[name + "gate_proj.weight"] = w13[expert, : moe.width]
        targets[name + "up_proj.weight"] = w13[expert, moe.width :]
        targets[name + "down_proj.weight"] = w2[expert]
        if moe.fp8 is not None:
            targets.update(_fp8_scale_targets(name, moe, expert))
    return targets


def _fp8_scale_targets(name: str, moe: SparseMoE, expert: int) -> dict[str, torch.Tensor]:
    """Expert `expert`'s scales (checkpoint names after `name`): w13_scale's first half of
    rows (channels or blocks) is the gate's, the second the up's."""
    assert moe.fp8 is not None
    scale13, scale2 = moe.w13_scale.data[expert], moe.w2_scale.data[expert]
    suffix = BLOCK_SCALE_SUFFIX if moe.fp8.block else WEIGHT_SCALE_SUFFIX
    half = scale13.shape[0] // GATED_PARTS
    return {
        f"{name}gate_proj.{suffix}": scale13[:half],
        f"{name}up_proj.{suffix}": scale13[half:],
        f"{name}down_proj.{suffix}": scale2,
    }


def _gpt_oss_targets(prefix: str, moe: SparseMoE) -> dict[str, torch.Tensor | ViewTarget]:
    assert moe.router_bias is not None and moe.w13_bias is not None and moe.w2_bias is not None
    experts = prefix + "experts."
    targets: dict[str, torch.Tensor | ViewTarget] = {
        f"{prefix}router.weight": moe.router.data,
        f"{prefix}router.bias": moe.router_bias.data,
        experts + "gate_up_proj_bias": _deinterleaved(moe.w13_bias.data, rows_dim=1),
        experts + "down_proj_bias": moe.w2_bias.data,
    }
    if moe.mxfp4_dropped:  # the FP8 copy that replaced them is no checkpoint tensor
        return targets
    if moe.is_mxfp4:
        targets[experts + "gate_up_proj_blocks"] = _deinterleaved(moe.w13_blocks.data, 1)
        targets[experts + "gate_up_proj_scales"] = _deinterleaved(moe.w13_scales.data, 1)
        targets[experts + "down_proj_blocks"] = moe.w2_blocks.data
        targets[experts + "down_proj_scales"] = moe.w2_scales.data
        return targets
    # transformers' unquantized layout: gate_up_proj [E, hidden, 2I] (columns interleaved),
    # down_proj [E, I, hidden]; both multiply as x @ w.
    w13 = moe.w13_weight.data
    num_experts, two_width, hidden = w13.shape
    interleaved_t = w13.view(num_experts, 2, two_width // 2, hidden).permute(0, 3, 2, 1)
    targets[experts + "gate_up_proj"] = ViewTarget(
        interleaved_t, torch.Size((num_experts, hidden, two_width))
    )
    targets[experts + "down_proj"] = moe.w2_weight.data.transpose(1, 2)
    return targets


def _deinterleaved(param: torch.Tensor, rows_dim: int) -> ViewTarget:
    """A target that reads interleaved rows (gate 0::2, up 1::2 along `rows_dim`) into
    `param`'s [gate; up] halves."""
    shape = param.shape
    num_rows = shape[rows_dim]
    split = param.view(*shape[:rows_dim], 2, num_rows // 2, *shape[rows_dim + 1 :])
    return ViewTarget(split.transpose(rows_dim, rows_dim + 1), shape)
