"""Packed int4 projections on the CPU (gpu/models/int4_linear.py), end to end: which
projections gpu/models/precision.py keeps packed, tiny GGUFs with Q4_0 / Q4_1 projections
and a Hugging Face directory under --quantization int4 against the same weights in float32,
and the embedded SmolLM2 GGUF's packed model against its float32 one (--quantization none).

The packed model is not the float32 model: its scales, zeros, activations and projection
outputs are bf16 (kernels/packed_cpu.py). The tolerances below are stated against what was
measured on the embedded model (teacher-forced over the README prompt's 40 greedy tokens:
max |logit difference| 0.66, mean 0.098; all 40 packed greedy tokens equal float32's on the
machine that measured it, but the first one is a near-tie in both: float32's top-2 margin
0.082, the packed model's 0.006, so the tests assert what holds whatever the CPU's kernel).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from gpu.attention.base import allocate_kv_cache
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.config import UnsupportedModelError
from gpu.models.int4_linear import (
    DENSE_COPY_MAX_BYTES,
    INT4_MAX_ROWS,
    SCALES_ZEROS_SUFFIX,
    Int4Weight,
    pack_int4_weights,
)
from gpu.models.llama import DecoderModel
from gpu.models.precision import Int4Scheme, resolve_precision
from gpu.models.presets import PRESETS
from gpu.models.quant_config import Int4Checkpoint
from gpu.weights.loader import ModelFiles, load_model_files
from kernels.packed_cpu import dequantize_int4_groups, quantize_int4_groups
from tests._embedded_model import needs_embedded_model
from tests.app._server_fixtures import shared_llm, shared_packed_llm
from tests.gpu._paged_kv_batch import PagedKVBook
from tests.gpu._tiny_checkpoints import tiny_hf_model, write_tiny_gguf

PROMPTS = [[1, 5, 9, 33, 70, 2, 8], [100, 3, 3, 41], [7, 64, 12, 90, 91, 5, 6, 120, 4, 11]]
README_PROMPT = "What is the capital of France?"
QUESTIONS = [
    README_PROMPT,
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Name the three primary colors.",
    "Who wrote Hamlet?",
    "Give me a tip for learning to code.",
]
MAX_LOGIT_ERROR = 1.0
"""Embedded model, packed vs float32, teacher-forced: largest |logit difference| allowed
(0.66 measured)."""
MEAN_LOGIT_ERROR = 0.2
"""... and mean over all positions and the vocabulary (0.098 measured)."""
CLEAR_MARGIN = 2 * MAX_LOGIT_ERROR
"""A float32 top-2 margin above which the packed argmax must be float32's."""


def _model(files: ModelFiles) -> DecoderModel:
    model = DecoderModel(
        files.config, TorchAttentionBackend(), torch.float32, "cpu", precision=files.precision
    )
    model.load_weights(dict(files.weights))
    return model


@torch.inference_mode()
def _all_logits(
    model: DecoderModel, prompts: list[list[int]]
) -> list[torch.Tensor]:  # per prompt [len, vocab] float32
    """Every position's logits, the prompts prefilled together in one varlen batch."""
    config = model.config
    book = PagedKVBook(num_blocks=64, block_size=16, seed=3)
    kv_caches = allocate_kv_cache(
        config.num_layers, 64, 16, model.num_kv_heads, config.head_dim, torch.float32, "cpu"
    )
    positions, metadata = book.step([(f"r{i}", len(p)) for i, p in enumerate(prompts)])
    input_ids = torch.tensor([t for p in prompts for t in p])
    logits = model.compute_logits(model(input_ids, positions, kv_caches, metadata))
    return list(logits.split([len(p) for p in prompts]))


def _int4_projections(model: DecoderModel) -> list[Int4Weight]:
    return [m for m in model.modules() if isinstance(m, Int4Weight)]


# ---- the precision plan -------------------------------------------------------------------


def test_auto_keeps_a_ggufs_q4_projections_packed_on_one_cpu_only() -> None:
    config = PRESETS["smollm2-135m"]
    modules = {f"model.layers.{i}.{p}" for i in range(config.num_layers) for p in _PARTS}
    q4 = Int4Checkpoint(frozenset(modules), ("Q4_1",))
    packed = resolve_precision(config, "auto", torch.float32, "cpu", int4_checkpoint=q4)
    assert packed.runs_int4 and not packed.runs_fp8
    assert packed.num_int4_projections == 7 * config.num_layers == 210
    assert set(packed.schemes.values()) == {Int4Scheme("Q4_1")}
    assert packed.describe(config) == (
        "weights: int4 (32-column groups from Q4_1 blocks, bf16 scales and activations) "
        "for 210 projections; float32 for lm_head, embeddings, norms"
    )
    dequantized = [
        resolve_precision(config, "none", torch.float32, "cpu", int4_checkpoint=q4),
        resolve_precision(config, "auto", torch.bfloat16, "cuda", (9, 0), int4_checkpoint=q4),
        resolve_precision(config, "auto", torch.float32, "cpu", tp_size=3, int4_checkpoint=q4),
        resolve_precision(config, "auto", torch.float32, "cpu"),  # not a Q4 GGUF
    ]
    assert not any(p.schemes for p in dequantized)
    assert dequantized[0].describe(config) == "weights: float32"
    # A fused group packs only when all of its parts are Q4 blocks; int4 quantizes the rest.
    partial = Int4Checkpoint(frozenset(modules - {"model.layers.3.self_attn.v_proj"}), ("Q4_1",))
    auto = resolve_precision(config, "auto", torch.float32, "cpu", int4_checkpoint=partial)
    assert auto.num_int4_projections == 207
    assert "model.layers.3.self_attn.qkv_proj" not in auto.schemes
    assert auto.describe(config) == (
        "weights: int4 (32-column groups from Q4_1 blocks, bf16 scales and activations) "
        "for 207 projections; float32 for 3 projections, lm_head, embeddings, norms"
    )
    forced = resolve_precision(config, "int4", torch.float32, "cpu", int4_checkpoint=partial)
    assert forced.schemes["model.layers.3.self_attn.qkv_proj"] == Int4Scheme()
    assert forced.num_int4_projections == 210


def test_int4_off_one_cpu_device_is_refused() -> None:
    config = PRESETS["smollm2-135m"]
    with pytest.raises(UnsupportedModelError, match="one CPU device only"):
        resolve_precision(config, "int4", torch.bfloat16, "cuda", (9, 0))
    with pytest.raises(UnsupportedModelError, match="one CPU device only"):
        resolve_precision(config, "int4", torch.float32, "cpu", tp_size=3)


_PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


# ---- tiny checkpoints -----------------------------------------------------------------------


@pytest.mark.parametrize("block_type", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_tiny_q4_gguf_loads_packed_and_matches_its_float32_model(
    tmp_path, arch: str, block_type: str
) -> None:
    """llama: q/k rows (codes and scales) unpermuted like float rows; qwen2: q/k/v biases
    on a packed projection; qwen3: q/k norms, head_dim 32."""
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_hf_model(arch), path, block_type)
    packed_files = load_model_files(path, torch.float32)
    float_files = load_model_files(path, torch.float32, quantization="none")
    precision = packed_files.precision
    assert precision.runs_int4 and precision.num_int4_projections == 14
    assert set(precision.schemes.values()) == {Int4Scheme(block_type)}
    assert f"from {block_type} blocks" in precision.describe(packed_files.config)
    assert not float_files.precision.schemes
    for name, weight in float_files.weights.items():
        if name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            codes = packed_files.weights[name]
            assert codes.dtype == torch.uint8 and codes.shape == weight.shape
            got = dequantize_int4_groups(
                codes, packed_files.weights[f"{module}.{SCALES_ZEROS_SUFFIX}"]
            )
            # The GGUF's own codes under bf16-rounded scales and zeros: a bf16-sized error.
            bound = 2**-7 * weight.abs().amax(dim=1, keepdim=True)
            assert ((got - weight).abs() <= bound).all(), name
        else:
            assert torch.equal(packed_files.weights[name], weight), name
    packed, reference = _model(packed_files), _model(float_files)
    assert len(_int4_projections(packed)) == 8  # qkv, o, gate_up, down of 2 layers
    assert all(p.is_packed and p.codes is None for p in _int4_projections(packed))
    for got, expected in zip(_all_logits(packed, PROMPTS), _all_logits(reference, PROMPTS)):
        scale = expected.abs().max()
        assert (got - expected).abs().max() <= 0.02 * scale
        assert (got - expected).abs().mean() <= 0.003 * scale


def test_quantization_int4_quantizes_a_float_checkpoint_at_load(tmp_path) -> None:
    """--quantization int4 on a Hugging Face directory: every projection quantized per 32
    columns at load; the packed model computes what float32 computes with the quantized
    weights (dequantized again), up to bf16 activations."""
    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    packed_files = load_model_files(str(tmp_path), torch.float32, quantization="int4")
    assert packed_files.precision.num_int4_projections == 14
    assert set(packed_files.precision.schemes.values()) == {Int4Scheme()}
    assert "quantized at load" in packed_files.precision.describe(packed_files.config)
    float_files = load_model_files(str(tmp_path), torch.float32, quantization="none")
    weights = dict(float_files.weights)
    for name in list(weights):
        if name.endswith("_proj.weight"):
            scales = packed_files.weights[name.replace(".weight", f".{SCALES_ZEROS_SUFFIX}")]
            weights[name] = dequantize_int4_groups(packed_files.weights[name], scales)
    same_weights = ModelFiles(float_files.config, weights, "", float_files.precision)
    packed, reference = _model(packed_files), _model(same_weights)
    for got, expected in zip(_all_logits(packed, PROMPTS), _all_logits(reference, PROMPTS)):
        assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_a_packed_projection_refuses_to_run_unpacked_and_float_codes() -> None:
    weight = Int4Weight(48, 70, Int4Scheme(), "cpu")
    assert weight.codes is not None and weight.codes.shape == (48, 96)  # whole 32-groups
    with pytest.raises(RuntimeError, match="loaded and packed"):
        weight(torch.zeros(1, 70))
    config = PRESETS["smollm2-135m"].replace(num_layers=1, vocab_size=64)
    precision = resolve_precision(config, "int4", torch.float32, "cpu")
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu", precision=precision)
    targets = model._weight_targets()
    weights = {name: torch.zeros(target.shape) for name, target in targets.items()}
    weights.update(
        {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in targets.items() if "scales" in n}
    )
    with pytest.raises(ValueError, match=r"mis-typed.*q_proj.weight: expected torch.uint8"):
        model.load_weights(weights)


@torch.inference_mode()
def test_large_steps_use_the_bf16_copy_and_small_ones_the_int4_codes() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 70) * 0.05
    codes, scales_zeros = quantize_int4_groups(w)
    dense = dequantize_int4_groups(codes, scales_zeros)[:, :70]
    weights = []
    for keep in (True, False):
        weight = Int4Weight(40, 70, Int4Scheme(), "cpu")
        assert weight.codes is not None and weight.scales_zeros is not None
        weight.codes.data.copy_(codes)
        weight.scales_zeros.data.copy_(scales_zeros)
        weight.pack(keep_dense_copy=keep)
        weights.append(weight)
    with_copy, codes_only = weights
    assert with_copy.dense_bf16 is not None and codes_only.dense_bf16 is None
    for rows in (1, INT4_MAX_ROWS):  # the int4 kernel, with or without a copy
        x = torch.randn(rows, 70)
        assert torch.equal(with_copy(x), codes_only(x))
    x = torch.randn(INT4_MAX_ROWS + 1, 70)
    bf16_product = F.linear(x.bfloat16(), dense.bfloat16()).float()
    assert torch.equal(with_copy(x), bf16_product)
    assert (codes_only(x) - x @ dense.T).abs().max() <= 0.02 * (x @ dense.T).abs().max()


def test_a_model_keeps_bf16_copies_only_within_the_budget() -> None:
    config = PRESETS["smollm2-135m"].replace(num_layers=1, vocab_size=64)
    precision = resolve_precision(config, "int4", torch.float32, "cpu")
    for budget, kept in ((0, False), (DENSE_COPY_MAX_BYTES, True)):
        model = DecoderModel(
            config, TorchAttentionBackend(), torch.float32, "cpu", precision=precision
        )
        for module in model.modules():
            if isinstance(module, Int4Weight):
                assert module.codes is not None and module.scales_zeros is not None
                module.codes.data.fill_(8)
                module.scales_zeros.data.fill_(1.0)
        pack_int4_weights(model, dense_copy_max_bytes=budget)
        copies = [m.dense_bf16 is not None for m in model.modules() if isinstance(m, Int4Weight)]
        assert copies and all(c == kept for c in copies)


# ---- the embedded model -------------------------------------------------------------------


EMBEDDED = dict(max_model_len=512, max_num_seqs=8, num_kv_blocks=64)


@pytest.fixture(scope="module")
def packed_llm() -> LLM:
    """The session's load of the packed default (tests/app/_server_fixtures.py)."""
    return LLM("default", reuse=shared_packed_llm(), runner="v2", **EMBEDDED)


@pytest.fixture(scope="module")
def float32_llm() -> LLM:
    """On the session's float32 model (tests/app/_server_fixtures.py), not another load."""
    return LLM("default", reuse=shared_llm(), runner="v2", quantization="none", **EMBEDDED)


@pytest.mark.slow
@needs_embedded_model
@torch.inference_mode()
def test_the_embedded_models_packed_greedy_tokens_hold_under_float32(
    packed_llm: LLM, float32_llm: LLM
) -> None:
    """The README prompt, 40 greedy tokens of each model, each teacher-forced through both:
    the logits agree within the stated tolerances, the packed argmax is float32's wherever
    float32's margin is clear, and every token the packed model chose is one float32
    rates within MAX_LOGIT_ERROR of its best."""
    assert packed_llm.worker.model.precision.num_int4_projections == 210
    assert "int4 (32-column groups from Q4_1 blocks" in packed_llm.worker.weights_precision
    assert float32_llm.worker.weights_precision == "weights: float32"
    float32_model = float32_llm.worker.model
    prompt = packed_llm.tokenizer.encode(packed_llm.apply_chat_template(README_PROMPT))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    packed_tokens = list(packed_llm.generate([prompt], params)[0].outputs[0].token_ids)
    float_tokens = list(float32_llm.generate([prompt], params)[0].outputs[0].token_ids)
    agree = next((i for i, (a, b) in enumerate(zip(packed_tokens, float_tokens)) if a != b), 40)
    print(f"\npacked vs float32 greedy: the first {agree} of 40 tokens agree")
    for tokens in (float_tokens, packed_tokens):
        ids = prompt + tokens
        [expected] = _all_logits(float32_model, [ids])
        [got] = _all_logits(packed_llm.worker.model, [ids])
        expected, got = expected[len(prompt) - 1 : -1], got[len(prompt) - 1 : -1]
        difference = (got - expected).abs()
        assert difference.max() < MAX_LOGIT_ERROR and difference.mean() < MEAN_LOGIT_ERROR
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
        assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
        chosen = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (top2[:, 0] - chosen < MAX_LOGIT_ERROR).all()


@needs_embedded_model
def test_compile_level_refuses_the_packed_model_before_loading_it() -> None:
    from actors.core.engine_startup import check_before_load
    from actors.protocol.config import EngineConfig
    from gpu.platform import probe_platform

    config = EngineConfig(model="default", device="cpu", compile_level=1)
    with pytest.raises(UnsupportedModelError, match=r"int4 projections.*--quantization none"):
        check_before_load(config, probe_platform("cpu"))
    check_before_load(config.replace(quantization="none"), probe_platform("cpu"))


@pytest.mark.slow
@needs_embedded_model
def test_v1_and_v2_give_the_same_tokens_on_the_packed_model(packed_llm: LLM) -> None:
    v1 = LLM("default", reuse=packed_llm, runner="v1", **EMBEDDED)
    assert v1.runner == "v1" and v1.worker.model.precision.runs_int4
    prompts = [packed_llm.apply_chat_template(q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens_v2 = [o.outputs[0].token_ids for o in packed_llm.generate(prompts, params)]
    tokens_v1 = [o.outputs[0].token_ids for o in v1.generate(prompts, params)]
    assert all(len(t) == 24 for t in tokens_v2)
    assert tokens_v1 == tokens_v2
