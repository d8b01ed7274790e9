"""The float8 (e4m3) KV cache in the kernels (--kv-cache-dtype fp8): the writes (kv_write,
qkv_prologue) quantize as the torch references do, byte for byte; paged attention over an
fp8 cache equals attention over a float cache holding the dequantized values, and stays
within fp8's error of attention over the unquantized cache. Triton runs in its CPU
interpreter here (float8 loads and stores work there; its float32 -> float8 cast does not
round, which is why kernels/_kv_fp8.py rounds in float32 bits first) and on CUDA devices
of compute capability 8.9+ (the `fp8_cuda_test` tests)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from kernels._kv_fp8 import FP8_KV_DTYPE, quantize_kv_ref
from kernels.kv_write import kv_write_ref, kv_write_triton
from kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton
from kernels.qkv_prologue import qkv_prologue_ref, qkv_prologue_triton
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)
from tests.kernels.test_paged_attention import Case, _inputs, _random_case
from tests.kernels.test_paged_attention_window import _sinks
from tests.kernels.test_qkv_prologue import _case as _prologue_case

K_SCALE, V_SCALE = 0.37, 1.9  # not 1.0, so that a scale left out shows
FP8_TOLERANCE = 2**-3
"""Attention over an fp8 cache vs the unquantized cache, in units of the values' largest
magnitude: e4m3 keeps 3 mantissa bits (each element within 2^-4 of itself, relatively),
and an output is a softmax-weighted mean of values whose weights move with the keys'
errors."""


def fp8_cuda_test(test: Callable[..., None]) -> Callable[..., None]:
    """A CUDA test that needs Triton's float8 e4m3 (compute capability 8.9+)."""
    old_gpu = not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9)
    skip = pytest.mark.skipif(old_gpu, reason="needs a CUDA GPU of compute capability 8.9+")
    return cuda_test(skip(test))


def _scales(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [] float32
    return torch.tensor(K_SCALE, device=device), torch.tensor(V_SCALE, device=device)


def _e4m3_grid(device: str = "cpu") -> torch.Tensor:  # [num_values] float32
    """Every finite e4m3 value times the scale, the midpoints between neighbours (the
    ties of round-to-nearest-even), values beyond +-448, and random ones."""
    finite = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    finite = finite[~finite.isnan()].sort().values
    midpoints = (finite[1:] + finite[:-1]) / 2
    generator = torch.Generator().manual_seed(0)
    grid = torch.cat(
        [
            finite,
            midpoints,
            torch.tensor([449.0, 464.0, 1e6, -1e6, -0.0]),
            torch.randn(4000, generator=generator) * 40,
            torch.randn(1000, generator=generator) * 1e-2,
        ]
    )
    return (grid * K_SCALE).to(device)


def test_quantize_ref_divides_by_the_scale_clamps_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([1.0, 3.125, 3.375, 1000.0, -1000.0, 3 * 2**-10, 5 * 2**-11])
    got = quantize_kv_ref(x, torch.tensor(0.5)).float()
    # 6.25 and 6.75 are ties between e4m3 neighbours 6.0/6.5 and 6.5/7.0, and 2.5 * 2^-9
    # one between subnormals 2 and 3 * 2^-9: each goes to the even one
    assert got.tolist() == [2.0, 6.0, 7.0, 448.0, -448.0, 3 * 2**-9, 2 * 2**-9]


def _write_case(
    num_tokens: int, dtype: torch.dtype, device: str, values: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys / values as strided views of a fused row, an fp8 cache, slots (every third
    token padding). `values` fills keys and values when given (then num_tokens follows)."""
    heads, head_dim, block_size = 2, 8, 4
    row = heads * head_dim
    generator = torch.Generator().manual_seed(num_tokens)
    if values is not None:
        num_tokens = -(-values.numel() // row)
    qkv = torch.randn(num_tokens, 3 * row, generator=generator) * 5
    if values is not None:
        filled = torch.zeros(num_tokens * row)
        filled[: values.numel()] = values.cpu()
        qkv[:, row : 2 * row] = filled.view(num_tokens, row)
        qkv[:, 2 * row :] = -filled.view(num_tokens, row)
    qkv = qkv.to(dtype).to(device)
    key = qkv[:, row : 2 * row].view(num_tokens, heads, head_dim)
    value = qkv[:, 2 * row :].view(num_tokens, heads, head_dim)
    num_blocks = -(-num_tokens // block_size) + 2
    cache = torch.zeros(2, num_blocks, block_size, heads, head_dim, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[1::3] = -1
    return key, value, cache.to(FP8_KV_DTYPE), slots.to(device)


def test_kv_write_ref_stores_the_quantized_rows_and_skips_padding() -> None:
    key, value, cache, slots = _write_case(7, torch.bfloat16, "cpu")
    k_scale, v_scale = _scales()
    kv_write_ref(key, value, cache, slots, k_scale, v_scale)
    flat = cache.view(torch.uint8).flatten(1, 2)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(
                flat[0, slot], quantize_kv_ref(key[token], k_scale).view(torch.uint8)
            )
            assert torch.equal(
                flat[1, slot], quantize_kv_ref(value[token], v_scale).view(torch.uint8)
            )
    unwritten = torch.ones(flat.shape[1], dtype=torch.bool)
    unwritten[slots[slots >= 0]] = False
    assert not flat[:, unwritten].any()


def test_a_float8_cache_needs_both_scales() -> None:
    key, value, cache, slots = _write_case(4, torch.float32, "cpu")
    k_scale, _ = _scales()
    for bad in ((None, None), (k_scale, None), (k_scale, torch.ones(2)), (k_scale, k_scale.half())):
        with pytest.raises(ValueError, match="needs (k|v)_scale as one float32 value"):
            kv_write_ref(key, value, cache, slots, *bad)
        with pytest.raises(ValueError, match="needs (k|v)_scale as one float32 value"):
            kv_write_triton(key, value, cache, slots, *bad)
    inputs = _fp8_inputs(Case(query_lens=(3, 1), seq_lens=(7, 5)))[0]
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_attention_ref(**{**inputs, "k_scale": None}, scale=1.0)
    prologue = _prologue_case(3, 4, 2, 16, torch.float32, True)
    prologue["kv_cache"] = prologue["kv_cache"].to(FP8_KV_DTYPE)
    with pytest.raises(ValueError, match="needs k_scale"):
        qkv_prologue_ref(**prologue)


def _fp8_inputs(
    case: Case, device: str = "cpu"
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The same attention three ways: over an fp8 cache (with its scales), over a cache in
    the query's dtype holding the dequantized values, and over the unquantized cache."""
    plain: dict[str, Any] = _inputs(case, device)
    k_scale, v_scale = _scales(device)
    fp8 = {
        **plain,
        "key_cache": quantize_kv_ref(plain["key_cache"], k_scale),
        "value_cache": quantize_kv_ref(plain["value_cache"], v_scale),
        "k_scale": k_scale,
        "v_scale": v_scale,
    }
    dequantized = {
        **plain,
        "key_cache": (fp8["key_cache"].float() * k_scale).to(case.dtype),
        "value_cache": (fp8["value_cache"].float() * v_scale).to(case.dtype),
    }
    return fp8, dequantized, plain


@pytest.mark.parametrize("window,with_sinks", [(None, False), (5, True), (16, False)])
def test_reference_on_fp8_equals_the_dequantized_cache_and_nears_the_unquantized(
    window: int | None, with_sinks: bool
) -> None:
    case = _random_case(6, (1, 37, 90), 120, num_heads=6, num_kv_heads=2, head_dim=32)
    fp8, dequantized, plain = _fp8_inputs(case)
    options: dict[str, Any] = dict(scale=32**-0.5, sliding_window=window)
    options["sinks"] = _sinks(6) if with_sinks else None
    out = paged_attention(**fp8, max_query_len=90, **options)
    torch.testing.assert_close(out, paged_attention_ref(**dequantized, **options))
    value_max = float(plain["value_cache"].abs().max())
    unquantized = paged_attention_ref(**plain, **options)
    torch.testing.assert_close(out, unquantized, rtol=0, atol=FP8_TOLERANCE * value_max)
    assert (out - unquantized).abs().mean() < FP8_TOLERANCE * value_max / 10


def _compare_writes(device: str, num_tokens: int, prologue_tokens: int) -> None:
    """kv_write and qkv_prologue, Triton vs reference, into fp8 caches (prologue_tokens:
    at most the 32 slots of the prologue test's cache)."""
    k_scale, v_scale = _scales(device)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        grid = _e4m3_grid(device)
        cases = [
            _write_case(0, dtype, device, grid) if dtype == torch.float32 else None,
            _write_case(num_tokens, dtype, device),
        ]
        for key, value, cache, slots in filter(None, cases):
            for slot_dtype in (torch.int64, torch.int32):
                expected, actual = cache.clone(), cache.clone()
                kv_write_ref(key, value, expected, slots, k_scale, v_scale)
                kv_write_triton(key, value, actual, slots.to(slot_dtype), k_scale, v_scale)
                assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
        case = _prologue_case(prologue_tokens, 4, 2, 16, dtype, True, device)
        case["kv_cache"] = case["kv_cache"].to(FP8_KV_DTYPE)
        expected, actual = case["kv_cache"].clone(), case["kv_cache"].clone()
        torch.testing.assert_close(
            qkv_prologue_triton(**{**case, "kv_cache": actual}, k_scale=k_scale, v_scale=v_scale),
            qkv_prologue_ref(**{**case, "kv_cache": expected}, k_scale=k_scale, v_scale=v_scale),
            rtol=3e-2,
            atol=3e-2,
        )
        # k is rounded to the model dtype by both before it is quantized; where they round
        # it differently (a float32 ulp, or the interpreter's bf16 truncation) the e4m3
        # values may differ by one step.
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-3, atol=2**-9)
        assert (actual.view(torch.uint8) != expected.view(torch.uint8)).float().mean() < 0.05


def _compare_attention(
    device: str, cases: Sequence[tuple[Case, int | None, bool, int | None]]
) -> None:
    """paged_attention_triton over fp8 caches vs the reference over the dequantized cache."""
    for case, window, with_sinks, num_kv_splits in cases:
        fp8, dequantized, _ = _fp8_inputs(case, device)
        sinks = _sinks(case.num_heads, device) if with_sinks else None
        options: dict[str, Any] = dict(
            scale=case.head_dim**-0.5, sliding_window=window, sinks=sinks
        )
        out = paged_attention_triton(
            **fp8, max_query_len=max(case.query_lens), max_seq_len=max(case.seq_lens),
            num_kv_splits=num_kv_splits, **options,
        )  # fmt: skip
        expected = paged_attention_ref(**dequantized, **options)
        num_real = sum(case.query_lens)
        tolerance = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[case.dtype]
        torch.testing.assert_close(
            out[:num_real], expected[:num_real], rtol=tolerance, atol=tolerance, msg=str(case)
        )


MIXED = Case(query_lens=(1, 20, 0, 9), seq_lens=(5, 29, 2, 9), num_padding_tokens=3)
DECODES = Case(query_lens=(1, 1, 0, 1), seq_lens=(5, 19, 3, 33), num_padding_tokens=2)
INTERPRETER_CASES = [
    (MIXED, None, False, 1),
    (MIXED, 5, True, 1),
    (DECODES, None, False, 3),  # split KV: the partial sums carry v_scale into the merge
    (DECODES, 16, True, 2),
    (dataclasses.replace(MIXED, dtype=torch.float16), None, True, 1),
]


def check_interpreted_fp8_kernels() -> None:
    """Runs in a child process with TRITON_INTERPRET=1 (see _triton_interpreter).
    bfloat16 attention is left to the GPU (the interpreter mis-computes bfloat16 tl.dot)."""
    from kernels import kv_write, paged_attention, qkv_prologue

    assert_interpreted(
        kv_write._kv_write_kernel,
        qkv_prologue._qkv_prologue_kernel,
        paged_attention._paged_attention_kernel,
    )
    _compare_writes("cpu", num_tokens=9, prologue_tokens=9)
    _compare_attention("cpu", INTERPRETER_CASES)


test_fp8_kernels_match_references_in_interpreter = interpreted_test(
    __file__, "check_interpreted_fp8_kernels"
)


@fp8_cuda_test
def test_fp8_writes_match_references_on_cuda() -> None:
    _compare_writes("cuda", num_tokens=2049, prologue_tokens=29)


QWEN3_HEADS = dict(num_heads=16, num_kv_heads=8, head_dim=128)


@fp8_cuda_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_attention_matches_the_dequantized_reference_on_cuda(dtype: torch.dtype) -> None:
    decodes = dataclasses.replace(_random_case(64, (), 2000, **QWEN3_HEADS), dtype=dtype)
    mixed = dataclasses.replace(
        _random_case(20, (1, 37, 300, 129), 700, num_heads=9, num_kv_heads=3, head_dim=64),
        dtype=dtype,
        num_padding_tokens=5,
    )
    cases: list[tuple[Case, int | None, bool, int | None]] = [
        (decodes, None, False, None),
        (decodes, None, False, 4),
        (decodes, 128, True, 4),
    ]
    cases += [(mixed, None, False, None), (mixed, 100, True, None)]
    _compare_attention("cuda", cases)


@fp8_cuda_test
def test_fp8_decode_graph_reads_the_scales_at_replay() -> None:
    case = dataclasses.replace(_random_case(32, (), 1000, **QWEN3_HEADS), dtype=torch.bfloat16)
    fp8, _, _ = _fp8_inputs(case, "cuda")
    scale = case.head_dim**-0.5

    def run() -> torch.Tensor:
        return paged_attention_triton(**fp8, scale=scale, max_query_len=1, max_seq_len=1000)

    run()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run()
    fp8["k_scale"].fill_(0.5)
    fp8["v_scale"].fill_(3.0)
    fp8["query"].normal_()
    graph.replay()
    torch.cuda.synchronize()
    dequantized = {
        **fp8,
        "key_cache": (fp8["key_cache"].float() * 0.5).bfloat16(),
        "value_cache": (fp8["value_cache"].float() * 3.0).bfloat16(),
        "k_scale": None,
        "v_scale": None,
    }
    expected = paged_attention_ref(**dequantized, scale=scale)
    torch.testing.assert_close(graph_out, expected, rtol=2e-2, atol=2e-2)
