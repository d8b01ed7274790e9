"""The transformers twin of a loaded Qwen3-MoE or gpt-oss model: the same logits and greedy
tokens as the transformers model the checkpoint came from; its experts are tandem's own
storage where the layouts agree, and its own copy (of the size it declares) where not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.hf_arms import (
    hf_model_sharing_weights,
    hf_own_weight_bytes,
    hf_room_problem,
    run_hf_static,
)
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.llama import DecoderModel
from gpu.models.moe import SparseMoE
from gpu.models.mxfp4_copy import add_mxfp4_copies
from gpu.models.presets import PRESETS
from gpu.weights.hf_loader import load_hf_dir
from tests.gpu.models._tiny_moe_models import SLIDING_WINDOW, save_tiny_moe_checkpoint

pytestmark = pytest.mark.slow

NAMES = ("qwen3_moe", "qwen3_moe_mixed", "gpt_oss", "gpt_oss_mxfp4")
# (the transformers model the checkpoint was saved from, tandem's model loaded from it)
Tiny = tuple[Any, DecoderModel]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Tiny]:
    cache: dict[str, Tiny] = {}

    def get(name: str) -> Tiny:
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            original = save_tiny_moe_checkpoint(name, directory)
            config, weights, _ = load_hf_dir(str(directory), torch.float32)
            model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu")
            model.load_weights(weights)
            cache[name] = (original, model)
        return cache[name]

    return get


def _prompt(vocab_size: int, length: int = 3 * SLIDING_WINDOW + 5) -> torch.Tensor:
    # longer than gpt-oss's sliding window, so that windowed and full layers differ
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_twin_matches_the_original_logits_and_greedy_tokens(
    tiny: Callable[[str], Tiny], name: str
) -> None:
    original, model = tiny(name)
    twin = hf_model_sharing_weights(model)
    ids = _prompt(model.config.vocab_size)
    assert (twin(ids).logits - original(ids).logits).abs().max().item() <= 1e-5
    short = ids[:, :5]  # decodes past the window through transformers' cache
    kwargs: dict[str, Any] = dict(max_new_tokens=3 * SLIDING_WINDOW, do_sample=False)
    assert torch.equal(twin.generate(short, **kwargs), original.generate(short, **kwargs))


def _moe_layers(model: DecoderModel, twin: Any) -> list[tuple[SparseMoE, Any]]:
    pairs = [
        (layer.mlp, hf_layer.mlp)
        for layer, hf_layer in zip(model.layers, twin.model.layers, strict=True)
        if isinstance(layer.mlp, SparseMoE)
    ]
    assert pairs
    return pairs


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_mixed"])
def test_qwen3_moe_experts_and_router_are_views(tiny: Callable[[str], Tiny], name: str) -> None:
    _, model = tiny(name)
    twin = hf_model_sharing_weights(model)
    for moe, hf_mlp in _moe_layers(model, twin):
        assert hf_mlp.experts.gate_up_proj.data_ptr() == moe.w13_weight.data_ptr()
        assert hf_mlp.experts.down_proj.data_ptr() == moe.w2_weight.data_ptr()
        assert hf_mlp.gate.weight.data_ptr() == moe.router.data_ptr()
    assert twin.config._attn_implementation == "sdpa"
    assert hf_own_weight_bytes(model.config, 4) == 0


def _storage_ptrs(module: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_mxfp4"])
def test_gpt_oss_copies_only_the_experts_it_must(tiny: Callable[[str], Tiny], name: str) -> None:
    _, model = tiny(name)
    twin = hf_model_sharing_weights(model)
    for layer, hf_layer in zip(model.layers, twin.model.layers, strict=True):
        assert layer.self_attn.sinks is not None
        assert hf_layer.self_attn.sinks.data_ptr() == layer.self_attn.sinks.data_ptr()
    for moe, hf_mlp in _moe_layers(model, twin):
        assert moe.router_bias is not None and moe.w2_bias is not None
        assert hf_mlp.router.weight.data_ptr() == moe.router.data_ptr()
        assert hf_mlp.router.bias.data_ptr() == moe.router_bias.data_ptr()
        assert hf_mlp.experts.down_proj_bias.data_ptr() == moe.w2_bias.data_ptr()
        if not moe.is_mxfp4:
            assert hf_mlp.experts.down_proj.data_ptr() == moe.w2_weight.data_ptr()
    assert twin.config._attn_implementation == "eager"
    # every parameter that is not tandem's storage is counted by hf_own_weight_bytes
    tandem_storage = _storage_ptrs(model)
    own = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for p in twin.parameters()
        if p.untyped_storage().data_ptr() not in tandem_storage
    }
    assert sum(own.values()) == hf_own_weight_bytes(model.config, 4) > 0


def test_gpt_oss_refuses_attention_without_sinks(tiny: Callable[[str], Tiny]) -> None:
    _, model = tiny("gpt_oss")
    with pytest.raises(ValueError, match="attention sinks"):
        hf_model_sharing_weights(model, attn_implementation="sdpa")


def test_run_hf_static_runs_gpt_oss_to_full_length(tiny: Callable[[str], Tiny]) -> None:
    _, model = tiny("gpt_oss_mxfp4")
    twin = hf_model_sharing_weights(model)
    prompts = _prompt(model.config.vocab_size, length=12).view(3, 4).tolist()
    run = run_hf_static(twin, prompts, output_len=5, batch_size=2)
    assert run.num_output_tokens == 3 * 5


GB = 10**9


def test_room_check_refuses_what_cannot_fit_beside_tandem() -> None:
    qwen, oss20, oss120 = (PRESETS[n] for n in ("qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b"))
    assert hf_room_problem(qwen, torch.bfloat16, 0, 80 * GB) is None
    needed_20b = hf_own_weight_bytes(oss20, 2)
    assert hf_room_problem(oss20, torch.bfloat16, needed_20b, 80 * GB) is None
    too_little = hf_room_problem(oss20, torch.bfloat16, needed_20b - 1, 80 * GB)
    assert too_little is not None and "gpu-memory-utilization" in too_little
    never = hf_room_problem(oss120, torch.bfloat16, 79 * GB, 80 * GB)
    assert never is not None and "gpt-oss-120b" in never and "cannot run" in never


@torch.no_grad()
def test_gpt_oss_whose_fp8_copy_replaced_its_mxfp4_experts(tmp_path: Path) -> None:
    """--mxfp4-copy fp8 frees the MXFP4 experts: the twin takes the copy's values, which
    are the MXFP4 ones exactly for these weights (none rounded)."""
    save_tiny_moe_checkpoint("gpt_oss_mxfp4", tmp_path)
    config, weights, _ = load_hf_dir(str(tmp_path), torch.float32)
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu")
    model.load_weights(weights)
    ids = _prompt(config.vocab_size)
    before = hf_model_sharing_weights(model)(ids).logits
    assert add_mxfp4_copies(model, "fp8").num_rounded == 0
    assert all(moe.mxfp4_dropped for moe, _ in _moe_layers(model, hf_model_sharing_weights(model)))
    assert torch.equal(hf_model_sharing_weights(model)(ids).logits, before)
