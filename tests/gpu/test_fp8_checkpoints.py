"""FP8 checkpoints end to end. On CPU (float32) every format, a Qwen3-MoE with FP8 experts
among them, loads to exactly the weights of the same checkpoint dequantized and saved
plain, and both runners decode the same greedy tokens from it; tensor-parallel ranks read
their slices of the scales; a tensor that contradicts quantization_config is refused.
Experts planned FP8 (as on a Hopper GPU) load into the stacked e4m3 tensors and scales
that the fused MoE reads (block scales from the checkpoint, per-channel ones quantized at
load), whose CPU reference computes the dequantized model. The gpu-marked tests run the
FP8 GEMMs on a CUDA GPU of compute capability >= 8.9: a tiny FP8 checkpoint against its
dequantized bf16 twin, FP8 experts against the bf16 model in eager steps and in V2's
CUDA graphs, and dummy weights quantized at load (--quantization fp8) through the V2
runner's CUDA graphs."""

from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from gpu.attention.base import allocate_kv_cache
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.config import UnsupportedModelError
from gpu.models.fp8_linear import Fp8Weight
from gpu.models.llama import DecoderModel
from gpu.models.moe import SparseMoE
from gpu.models.precision import Fp8Scheme, WeightPrecision, resolve_precision
from gpu.weights.hf_loader import load_hf_config, load_hf_dir
from gpu.weights.loader import ModelLoadError, load_model_files
from gpu.weights.shard_layout import take_shard, weight_shard_slices
from gpu.weights.shard_loader import load_weight_shard
from kernels.fp8_experts import Fp8Experts
from tests.gpu._paged_kv_batch import PagedKVBook
from tests.gpu._tiny_fp8_checkpoints import FORMATS, build_fp8_tiny_model, write_fp8_checkpoint

pytestmark = pytest.mark.slow  # transformers builds the tiny models

Pair = tuple[str, str]  # (fp8 checkpoint, the same weights dequantized)
OPTIONS = dict(
    device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
    max_num_batched_tokens=16,
)  # fmt: skip
NUM_NEW_TOKENS = 12
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability >= 8.9",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Pair]:
    cache: dict[tuple, Pair] = {}

    def get(name: str, **sizes: float) -> Pair:
        key = (name, *sorted(sizes.items()))
        if key not in cache:
            fmt = FORMATS[name]
            root = tmp_path_factory.mktemp(name)
            model = build_fp8_tiny_model(fmt.architecture, **sizes)
            write_fp8_checkpoint(model, fmt, root / "fp8", root / "plain")
            cache[key] = (str(root / "fp8"), str(root / "plain"))
        return cache[key]

    return get


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in (9, 3, 20)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", FORMATS)
def test_cpu_loads_exactly_the_dequantized_weights(checkpoint, name: str) -> None:
    fp8_dir, plain_dir = checkpoint(name)
    fp8, plain = (
        load_model_files(fp8_dir, torch.float32),
        load_model_files(plain_dir, torch.float32),
    )
    assert fp8.config.fp8 is not None and plain.config.fp8 is None
    assert fp8.weights.keys() == plain.weights.keys()
    for key, tensor in plain.weights.items():
        assert fp8.weights[key].dtype == torch.float32 and torch.equal(fp8.weights[key], tensor), (
            key
        )
    assert fp8.precision.describe(fp8.config) == (
        "weights: float32 (fp8 checkpoint dequantized at load)"
    )


@pytest.mark.parametrize("name", FORMATS)
def test_both_runners_decode_the_dequantized_checkpoints_tokens(checkpoint, name: str) -> None:
    fp8_dir, plain_dir = checkpoint(name)
    prompts = _prompts(96)
    expected = _greedy(LLM(plain_dir, runner="v2", **OPTIONS), prompts)
    v2 = LLM(fp8_dir, runner="v2", **OPTIONS)
    v1 = LLM(fp8_dir, reuse=v2, runner="v1", **OPTIONS)
    assert _greedy(v2, prompts) == expected and _greedy(v1, prompts) == expected
    assert v2.worker.weights_precision.endswith("(fp8 checkpoint dequantized at load)")


def test_quantization_none_dequantizes_too(checkpoint) -> None:
    fp8_dir, plain_dir = checkpoint("ct_channel")
    prompts = _prompts(96)
    llm = LLM(fp8_dir, runner="v2", quantization="none", **OPTIONS)
    assert _greedy(llm, prompts) == _greedy(LLM(plain_dir, runner="v2", **OPTIONS), prompts)
    notes = llm.worker.model.precision.notes
    assert notes and "--quantization none" in notes[0]


# head_dim 128 and MLP width 256: every rank's slice of 2 holds whole 128-blocks.
TP_SIZES = dict(head_dim=128, intermediate_size=256)


@pytest.mark.parametrize("name", ["fp8_block", "ct_channel", "fp8_tensor_static"])
def test_tensor_parallel_ranks_read_their_slices_of_the_scales(checkpoint, name: str) -> None:
    fp8_dir, _ = checkpoint(name, **TP_SIZES)
    config, full, _ = load_hf_dir(fp8_dir, torch.float32)  # dequantized on CPU
    for rank in range(2):
        _, shard, _ = load_hf_dir(fp8_dir, torch.float32, "cpu", rank, 2)
        slices = weight_shard_slices(config, rank, 2)
        for key, tensor in shard.items():
            assert torch.equal(tensor, take_shard(full[key], slices[key])), key


def test_tensor_parallel_fp8_shards_keep_their_scales(checkpoint) -> None:
    fp8_dir, _ = checkpoint("fp8_block", **TP_SIZES)
    config = load_hf_config(fp8_dir)
    whole = resolve_precision(config, "auto", torch.float32, "cuda", (9, 0))
    _, full, _ = load_hf_dir(fp8_dir, torch.float32, precision=whole)
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"  # 2 KV heads: one per rank
    assert full[name].shape == (2, 2)
    for rank in range(2):
        precision = resolve_precision(config, "auto", torch.float32, "cuda", (9, 0), True, rank, 2)
        _, shard, _ = load_hf_dir(fp8_dir, torch.float32, "cpu", rank, 2, precision)
        assert torch.equal(shard[name], full[name][rank : rank + 1])
        o_scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"  # row-parallel: columns
        assert torch.equal(shard[o_scale], full[o_scale][:, 2 * rank : 2 * rank + 2])


def test_block_fp8_slices_that_cut_a_block_are_refused(checkpoint) -> None:
    fp8_dir, _ = checkpoint("fp8_block")  # 2 KV heads of 64 rows: 64 rows per rank
    with pytest.raises(UnsupportedModelError, match="tensor parallel size 2") as error:
        load_weight_shard(fp8_dir, torch.float32, "cpu", 0, 2)
    assert "\n" not in str(error.value)


def _rewrite(directory: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = Path(directory) / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_a_tensor_that_contradicts_quantization_config_is_refused(checkpoint, tmp_path) -> None:
    fp8_dir, plain_dir = checkpoint("ct_channel")
    config = json.loads((Path(fp8_dir) / "config.json").read_text())
    bf16_dir = tmp_path / "bf16"  # the plain weights under the fp8 config
    bf16_dir.mkdir()
    (bf16_dir / "config.json").write_text(json.dumps(config))
    save_file(load_file(Path(plain_dir) / "model.safetensors"), bf16_dir / "model.safetensors")
    precision = resolve_precision(
        load_hf_config(str(bf16_dir)), "auto", torch.float32, "cuda", (9, 0)
    )
    with pytest.raises(ValueError, match="quantization_config says the module is fp8"):
        load_hf_dir(str(bf16_dir), torch.float32, precision=precision)
    missing_scale = "model.layers.0.mlp.down_proj.weight_scale"
    _rewrite(str(bf16_dir), lambda t: t.clear())
    save_file(load_file(Path(fp8_dir) / "model.safetensors"), bf16_dir / "model.safetensors")
    _rewrite(str(bf16_dir), lambda t: t.pop(missing_scale))
    with pytest.raises(ModelLoadError, match=f"missing weight '{missing_scale}'"):
        load_model_files(str(bf16_dir), torch.float32)


def _experts_only(directory: str, requested: str) -> WeightPrecision:
    """The plan on a Hopper GPU (mocked) less its dense FP8 projections: the experts alone
    stay FP8, which the fused MoE's CPU reference runs too."""
    precision = resolve_precision(
        load_hf_config(directory), requested, torch.float32, "cuda", (9, 0)
    )
    return dataclasses.replace(precision, schemes={}, notes=())


def _cpu_model(directory: str, precision: WeightPrecision | None = None) -> DecoderModel:
    config, weights, _ = load_hf_dir(directory, torch.float32, precision=precision)
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu", precision=precision)
    model.load_weights(weights)
    return model


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)  # float8 has no CPU comparison kernels


def test_fp8_experts_load_stacked_and_compute_the_dequantized_model(checkpoint) -> None:
    fp8_dir, plain_dir = checkpoint("fp8_block_moe")
    precision = _experts_only(fp8_dir, "auto")
    assert precision.experts == Fp8Scheme(block=True)
    model = _cpu_model(fp8_dir, precision)
    moe = model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.w13, Fp8Experts) and moe.w13.block
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
    # 160 rows a half: two block rows each (the fused 320 rows would have three)
    assert moe.w13_scale.shape == (8, 4, 2) and moe.w2_scale.shape == (8, 2, 2)
    file = load_file(Path(fp8_dir) / "model.safetensors")
    up, down = "model.layers.1.mlp.experts.5.up_proj", "model.layers.1.mlp.experts.5.down_proj"
    assert torch.equal(_bits(moe.w13_weight[5, 160:]), _bits(file[up + ".weight"]))
    assert torch.equal(moe.w13_scale[5, 2:], file[up + ".weight_scale_inv"])
    assert torch.equal(_bits(moe.w2_weight[5]), _bits(file[down + ".weight"]))
    assert torch.equal(moe.w2_scale[5], file[down + ".weight_scale_inv"])
    prompt = _prompts(96)[2]
    expected = _logits(_cpu_model(plain_dir), prompt, "cpu")
    torch.testing.assert_close(_logits(model, prompt, "cpu"), expected, rtol=1e-5, atol=1e-5)


def test_quantization_fp8_quantizes_each_expert_per_output_channel(checkpoint) -> None:
    _, plain_dir = checkpoint("fp8_block_moe")
    precision = _experts_only(plain_dir, "fp8")
    assert precision.experts == Fp8Scheme(block=False, quantized_at_load=True)
    moe = _cpu_model(plain_dir, precision).layers[1].mlp
    assert moe.w13_weight.dtype == torch.float8_e4m3fn
    assert moe.w13_scale.shape == (8, 320) and moe.w2_scale.shape == (8, 192)
    file = load_file(Path(plain_dir) / "model.safetensors")
    for rows, name in ((slice(0, 160), "gate_proj"), (slice(160, 320), "up_proj")):
        weight = file[f"model.layers.1.mlp.experts.2.{name}.weight"]
        scale = moe.w13_scale[2, rows]
        assert torch.equal(scale, weight.abs().amax(dim=1) / 448)
        dequantized = moe.w13_weight[2, rows].float() * scale[:, None]
        # e4m3 rounds to 3 mantissa bits; below 2**-6 (subnormals) to steps of 2**-9
        torch.testing.assert_close(
            dequantized, weight, rtol=2**-4, atol=float(scale.max()) * 2**-10
        )


# ---- CUDA, compute capability >= 8.9 ----------------------------------------------------


def _logits(model: DecoderModel, prompt: list[int], device: str = "cuda") -> torch.Tensor:
    """[len(prompt), vocab] float32 on the CPU: one prefill of the whole prompt."""
    book = PagedKVBook(64, 16, seed=1)
    positions, metadata = book.step([("r", len(prompt))], device=device)
    config = model.config
    kv_caches = allocate_kv_cache(
        config.num_layers, 64, 16, config.num_kv_heads, config.head_dim, model.dtype, device
    )
    with torch.no_grad():
        hidden = model(torch.tensor(prompt, device=device), positions, kv_caches, metadata)
        return model.compute_logits(hidden[: metadata.num_actual_tokens]).cpu()


@pytest.fixture(autouse=True)
def _free_the_gpu_after_each_test() -> Iterator[None]:
    """Models and engines here hold GPU memory through reference cycles: collected after
    each test, so that later tests size their KV caches on a free GPU."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cuda_model(directory: str, quantization: str) -> DecoderModel:
    from gpu.attention.triton_backend import TritonAttentionBackend

    files = load_model_files(directory, torch.bfloat16, "cuda", quantization)
    model = DecoderModel(
        files.config, TritonAttentionBackend(), torch.bfloat16, "cuda", precision=files.precision
    )
    model.load_weights(files.weights)
    return model


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("name", ["fp8_block", "ct_channel", "ct_static"])
def test_fp8_gemms_on_cuda_stay_close_to_the_dequantized_bf16_model(checkpoint, name) -> None:
    # 128-row multiples, so that block-scaled q/k/v and gate/up fuse and run in FP8.
    fp8_dir, _ = checkpoint(name, initializer_range=0.05, hidden_size=256, intermediate_size=512)
    fp8_model, bf16_model = _cuda_model(fp8_dir, "auto"), _cuda_model(fp8_dir, "none")
    layer = fp8_model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Weight)
    assert isinstance(layer.mlp.gate_up_proj, Fp8Weight)
    assert not fp8_model.precision.notes
    prompt = _prompts(96)[2]
    got, expected = _logits(fp8_model, prompt), _logits(bf16_model, prompt)
    assert torch.isfinite(got).all()
    # FP8 noise, not a wrong scale: on an H100 the block checkpoint differed by 0.065 mean /
    # 0.64 max and the per-channel twin (whose projections also quantize activations per
    # token) by 0.092 / 0.86, against logits up to 3.4, with 95% of argmaxes equal; a scale
    # read from the wrong block or channel moves logits by their own size.
    difference, scale = (got - expected).abs(), expected.abs().max()
    assert difference.mean() < 0.05 * scale and difference.max() < 0.35 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
    llm = LLM(fp8_dir, device="cuda", max_model_len=128, num_kv_blocks=64)
    assert llm.worker.weights_precision.startswith("weights: fp8 (")
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in _greedy(llm, _prompts(96)))


@pytest.mark.gpu
@needs_fp8_gpu
def test_dummy_weights_quantized_at_load_run_through_the_v2_cuda_graphs() -> None:
    options = dict(device="cuda", max_model_len=256, num_kv_blocks=128, max_num_seqs=8)
    llm = LLM("dummy:smollm2-135m", runner="v2", quantization="fp8", **options)
    assert llm.runner == "v2" and llm.worker.graphs is not None
    assert llm.worker.graphs.num_captured > 0
    assert isinstance(llm.worker.model.layers[0].mlp.down_proj, Fp8Weight)
    assert llm.worker.weights_precision == (
        "weights: fp8 (per-channel, quantized at load, dynamic per-token activations) for "
        "210 projections; bfloat16 for lm_head, embeddings, norms"
    )
    prompts = [[5 + i, 17, 300 + i] for i in range(6)]
    first, second = _greedy(llm, prompts), _greedy(llm, prompts)
    assert first == second and all(len(tokens) == NUM_NEW_TOKENS for tokens in first)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("quantization", ["auto", "fp8"])
def test_fp8_experts_on_cuda_stay_close_to_the_bf16_model(checkpoint, quantization) -> None:
    """auto: the checkpoint's block-scaled experts; fp8: the plain twin's experts quantized
    per output channel at load. Either way the experts stay float8 on the GPU, in eager
    steps and in the V2 runner's CUDA graphs."""
    sizes = dict(initializer_range=0.05, hidden_size=256, intermediate_size=512)
    fp8_dir, plain_dir = checkpoint("fp8_block_moe", **sizes)
    directory = fp8_dir if quantization == "auto" else plain_dir
    fp8_model, bf16_model = _cuda_model(directory, quantization), _cuda_model(plain_dir, "auto")
    moe = fp8_model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.w13, Fp8Experts)
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
    assert moe.w13.block == (quantization == "auto") and not fp8_model.precision.notes
    assert bf16_model.layers[1].mlp.w13_weight.dtype == torch.bfloat16
    prompt = _prompts(96)[2]
    got, expected = _logits(fp8_model, prompt), _logits(bf16_model, prompt)
    assert torch.isfinite(got).all()
    # FP8 noise, not a wrong scale: on an H100 the block checkpoint differed by 0.065 mean /
    # 0.64 max and the per-channel twin (whose projections also quantize activations per
    # token) by 0.092 / 0.86, against logits up to 3.4, with 95% of argmaxes equal; a scale
    # read from the wrong block or channel moves logits by their own size.
    difference, scale = (got - expected).abs(), expected.abs().max()
    assert difference.mean() < 0.05 * scale and difference.max() < 0.35 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
    options = dict(device="cuda", max_model_len=128, num_kv_blocks=64, max_num_seqs=4)
    llm = LLM(directory, runner="v2", quantization=quantization, **options)
    assert llm.worker.graphs is not None and llm.worker.graphs.num_captured > 0
    assert "; fp8 for experts (weight-only, " in llm.worker.weights_precision
    # the tokens decoded through the graphs are (nearly all) the bf16 model's greedy picks
    prompts = _prompts(96)
    picks, gaps = [], []
    for prompt, tokens in zip(prompts, _greedy(llm, prompts), strict=True):
        logits = _logits(bf16_model, prompt + tokens[:-1])[len(prompt) - 1 :]
        chosen = torch.tensor(tokens)
        picks.append(logits.argmax(-1) == chosen)
        gaps.append(logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0])
    assert torch.cat(picks).float().mean() >= 0.8
    assert torch.cat(gaps).max() < 0.2 * expected.abs().max()
