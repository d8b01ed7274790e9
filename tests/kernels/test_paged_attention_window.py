"""Sliding-window attention and attention sinks in kernels/paged_attention.py: the torch
reference against an independent dense reference (transformers' masks and gpt-oss
softmax), the Triton kernel against the reference in the interpreter (prefill chunks,
decodes, split-KV decodes, GQA packing, chunks beyond the window) and on CUDA, and a
check that no KV slot below the window is read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import _paged_attention_tiling as tiling_module
from kernels import paged_attention as paged_attention_module
from kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)
from tests.kernels._dense_attention import dense_attention
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)
from tests.kernels.test_paged_attention import Case, _inputs, _random_case

SCALE = 0.3
# decodes, prefill chunks with and without context, a zero-length request, padding
MIXED = Case(
    query_lens=(1, 20, 1, 9, 0), seq_lens=(40, 60, 7, 9, 3), block_size=16, num_padding_tokens=2
)
# chunks whose context is longer than the window: the first starts beyond it, the second
# crosses it (its first rows see position 0, its last rows do not); GQA of 4, head_dim 64
BEYOND = Case(
    query_lens=(24, 12, 1),
    seq_lens=(90, 40, 70),
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
)
# decodes only (for the split-KV path), GQA of 3
DECODES = Case(
    query_lens=(1, 1, 0, 1),
    seq_lens=(5, 50, 3, 70),
    num_heads=6,
    num_kv_heads=2,
    block_size=16,
    num_padding_tokens=1,
)
# (case, sliding_window, with sinks, num_kv_splits, kv_tile_len, query_tile)
INTERPRETER_CASES = [
    (MIXED, 5, True, 1, 16, None),
    (MIXED, 16, False, 1, 16, None),
    (MIXED, 37, True, 1, 16, 16),  # decode-sized query tiles: several q blocks per chunk
    (MIXED, 1, True, 1, 16, None),
    (MIXED, 1000, True, 1, None, None),  # window longer than every sequence
    (MIXED, None, True, 1, 16, None),
    (dataclasses.replace(MIXED, dtype=torch.float16), 16, True, 1, 16, None),
    (BEYOND, 37, True, 1, 16, None),
    (BEYOND, 16, False, 1, None, None),
    (BEYOND, 5, True, 1, 16, 16),
    (DECODES, 5, True, 3, 16, None),
    (DECODES, 16, True, 4, 16, None),  # more splits than window tiles: some splits see nothing
    (DECODES, 1, True, 2, 16, None),
    (DECODES, None, True, 3, 16, None),
    (DECODES, 37, False, 3, 16, None),
]
POISON_CASES = [INTERPRETER_CASES[i] for i in (0, 2, 7, 9, 11)]


def _sinks(num_heads: int, device: str = "cpu") -> torch.Tensor:  # [num_heads] float32
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(7)) * 2
    sinks[0] = 6.0  # a sink that outweighs most keys
    return sinks.to(device)


def _request_kv(inputs: dict[str, torch.Tensor], req: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request req's keys and values, contiguous, [seq_len, num_kv_heads, head_dim] each."""
    block_size = inputs["key_cache"].shape[1]
    positions = torch.arange(int(inputs["seq_lens"][req]))
    slots = inputs["block_table"][req, positions // block_size].long() * block_size
    slots += positions % block_size
    return (
        inputs["key_cache"].flatten(0, 1)[slots],
        inputs["value_cache"].flatten(0, 1)[slots],
    )


def _first_window_starts(case: Case, sliding_window: int) -> list[int]:
    """Per request, the first key its chunk's first query sees."""
    return [
        max(seq_len - query_len - sliding_window + 1, 0)
        for query_len, seq_len in zip(case.query_lens, case.seq_lens, strict=True)
    ]


def _poison_below_windows(
    case: Case, inputs: dict[str, torch.Tensor], sliding_window: int
) -> dict[str, torch.Tensor]:
    """A copy whose slots below each request's first window hold NaN, and whose blocks
    wholly below it are swapped for an unused block full of NaN."""
    poisoned = {name: tensor.clone() for name, tensor in inputs.items()}
    block_size = case.block_size
    used_blocks = set(inputs["block_table"].flatten().tolist())
    spare_block = next(b for b in range(inputs["key_cache"].shape[0]) if b not in used_blocks)
    for cache in (poisoned["key_cache"], poisoned["value_cache"]):
        cache[spare_block] = float("nan")
    for req, kv_start in enumerate(_first_window_starts(case, sliding_window)):
        for pos in range(kv_start):
            block = int(poisoned["block_table"][req, pos // block_size])
            for cache in (poisoned["key_cache"], poisoned["value_cache"]):
                cache[block, pos % block_size] = float("nan")
        poisoned["block_table"][req, : kv_start // block_size] = spare_block
    return poisoned


@pytest.mark.parametrize("window", [None, 1, 5, 16, 37, 1000])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", [MIXED, BEYOND, DECODES], ids=["mixed", "beyond", "decodes"])
def test_ref_matches_dense_transformers_attention(
    case: Case, window: int | None, with_sinks: bool
) -> None:
    inputs = _inputs(case)
    sinks = _sinks(case.num_heads) if with_sinks else None
    out = paged_attention_ref(**inputs, scale=SCALE, sliding_window=window, sinks=sinks)
    starts = inputs["query_start_loc"].tolist()
    for req in range(len(case.seq_lens)):
        start, end = starts[req], starts[req + 1]
        keys, values = _request_kv(inputs, req)
        expected = dense_attention(inputs["query"][start:end], keys, values, SCALE, window, sinks)
        torch.testing.assert_close(out[start:end].double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[sum(case.query_lens) :], torch.zeros_like(out[sum(case.query_lens) :]))


def test_sink_lowers_the_weight_of_every_key_equally() -> None:
    # one key: plain attention returns its value; a sink of logit s scales it by
    # exp(q.k) / (exp(q.k) + exp(s)), here with q.k = 0 by zero keys: 1 / (1 + e^s)
    case = Case(query_lens=(1,), seq_lens=(1,), num_heads=2, num_kv_heads=1, block_size=16)
    inputs = _inputs(case)
    inputs["key_cache"].zero_()
    sinks = torch.tensor([0.0, 2.0])
    out = paged_attention_ref(**inputs, scale=1.0, sinks=sinks)
    value = _request_kv(inputs, 0)[1][0, 0]
    torch.testing.assert_close(out[0, 0], value / 2)
    torch.testing.assert_close(out[0, 1], value / (1 + torch.e**2))


@pytest.mark.parametrize("case_index", range(len(POISON_CASES)))
def test_ref_reads_nothing_below_the_window(case_index: int) -> None:
    case, window, _, _, _, _ = POISON_CASES[case_index]
    inputs = _inputs(case)
    sinks = _sinks(case.num_heads)
    clean = paged_attention_ref(**inputs, scale=SCALE, sliding_window=window, sinks=sinks)
    poisoned = _poison_below_windows(case, inputs, window)
    out = paged_attention_ref(**poisoned, scale=SCALE, sliding_window=window, sinks=sinks)
    assert torch.equal(out, clean)


def test_dispatcher_passes_window_and_sinks_to_the_reference_on_cpu() -> None:
    inputs = _inputs(MIXED)
    sinks = _sinks(MIXED.num_heads)
    out = paged_attention(**inputs, scale=SCALE, max_query_len=20, sliding_window=5, sinks=sinks)
    expected = paged_attention_ref(**inputs, scale=SCALE, sliding_window=5, sinks=sinks)
    assert torch.equal(out, expected)
    assert not torch.equal(out, paged_attention_ref(**inputs, scale=SCALE, sliding_window=5))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"sliding_window": 0}, "sliding_window must be"),
        ({"sliding_window": 2.5}, "sliding_window must be"),
        ({"sliding_window": True}, "sliding_window must be"),
        ({"sinks": torch.zeros(3)}, "sinks must be"),
        ({"sinks": torch.zeros(4, dtype=torch.int32)}, "sinks must be"),
        ({"sinks": torch.zeros(4, 2)[:, 0]}, "sinks must be"),
    ],
)
def test_bad_window_or_sinks_raise_clear_errors(kwargs: dict, message: str) -> None:
    inputs = _inputs(Case(query_lens=(3, 1), seq_lens=(7, 5)))
    with pytest.raises(ValueError, match=message):
        paged_attention_ref(**inputs, scale=1.0, **kwargs)
    with pytest.raises(ValueError, match=message):
        paged_attention_triton(**inputs, scale=1.0, max_query_len=3, **kwargs)


def test_split_heuristic_counts_only_the_window_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiling_module, "_num_sms", lambda device: 132)
    splits = tiling_module.default_num_kv_splits
    cuda = torch.device("cuda")
    # one request, 8 kv heads, 4k context: 16 splits of 4 tiles of 64 keys
    assert splits(cuda, 8, 4096, 64) == 16
    # a window of 128 spans at most 3 tiles: not worth splitting
    assert splits(cuda, 8, 4096, 64, sliding_window=128) == 1
    assert splits(cuda, 8, None, 64, sliding_window=128) == 1
    # a window of 1024 spans at most 17 tiles: 5 splits; a shorter sequence bounds it first
    assert splits(cuda, 8, 4096, 64, sliding_window=1024) == 5
    assert splits(cuda, 8, 300, 64, sliding_window=1024) == 2


def check_interpreted_kernel_matches_reference() -> None:
    """Runs in a child process with TRITON_INTERPRET=1 (see _triton_interpreter)."""
    assert_interpreted(
        paged_attention_module._paged_attention_kernel,
        paged_attention_module._merge_splits_kernel,
    )
    for case, window, with_sinks, num_kv_splits, kv_tile_len, query_tile in INTERPRETER_CASES:
        inputs = _inputs(case)
        sinks = _sinks(case.num_heads) if with_sinks else None
        expected = paged_attention_ref(**inputs, scale=SCALE, sliding_window=window, sinks=sinks)
        out = paged_attention_triton(
            **inputs, scale=SCALE, max_query_len=max(case.query_lens),
            num_kv_splits=num_kv_splits, kv_tile_len=kv_tile_len, query_tile=query_tile,
            sliding_window=window, sinks=sinks,
        )  # fmt: skip
        num_real = sum(case.query_lens)
        tolerance = 1e-5 if case.dtype == torch.float32 else 2e-3
        torch.testing.assert_close(
            out[:num_real], expected[:num_real], rtol=tolerance, atol=tolerance,
            msg=lambda m, c=case, w=window, s=with_sinks: f"{c} window={w} sinks={s}: {m}",
        )  # fmt: skip


def check_interpreted_kernel_reads_nothing_below_the_window() -> None:
    """Runs in a child process with TRITON_INTERPRET=1."""
    assert_interpreted(paged_attention_module._paged_attention_kernel)
    for case, window, _, num_kv_splits, kv_tile_len, query_tile in POISON_CASES:
        inputs = _inputs(case)
        sinks = _sinks(case.num_heads)
        expected = paged_attention_ref(**inputs, scale=SCALE, sliding_window=window, sinks=sinks)
        out = paged_attention_triton(
            **_poison_below_windows(case, inputs, window), scale=SCALE,
            max_query_len=max(case.query_lens), num_kv_splits=num_kv_splits,
            kv_tile_len=kv_tile_len, query_tile=query_tile, sliding_window=window, sinks=sinks,
        )  # fmt: skip
        num_real = sum(case.query_lens)
        assert out[:num_real].isfinite().all(), f"{case} window={window}: read below the window"
        torch.testing.assert_close(out[:num_real], expected[:num_real], rtol=1e-5, atol=1e-5)


def check_interpreted_window_over_everything_equals_no_window() -> None:
    """Runs in a child process with TRITON_INTERPRET=1: a window longer than every
    sequence changes no bit of the output."""
    assert_interpreted(paged_attention_module._paged_attention_kernel)
    for case, num_kv_splits in ((MIXED, 1), (DECODES, 3)):
        inputs = _inputs(case)
        knobs = dict(max_query_len=max(case.query_lens), num_kv_splits=num_kv_splits)
        full = paged_attention_triton(**inputs, scale=SCALE, **knobs)
        windowed = paged_attention_triton(**inputs, scale=SCALE, sliding_window=500, **knobs)
        num_real = sum(case.query_lens)
        assert torch.equal(windowed[:num_real], full[:num_real])


def check_interpreted_kernel() -> None:
    """One child process for the three interpreted checks (each process start costs)."""
    check_interpreted_kernel_matches_reference()
    check_interpreted_kernel_reads_nothing_below_the_window()
    check_interpreted_window_over_everything_equals_no_window()


# Matches the reference, reads no KV below the window, and a window over everything is
# bit-identical to none.
test_triton_kernel_with_window_and_sinks_in_interpreter = interpreted_test(
    __file__, "check_interpreted_kernel"
)


GPT_OSS_HEADS = dict(num_heads=64, num_kv_heads=8, head_dim=64)
GPU_CASES = {  # (case, sliding_window, num_kv_splits)
    "decode_1_long_window": (
        Case(query_lens=(1,), seq_lens=(4000,), block_size=16, **GPT_OSS_HEADS),
        128,
        None,
    ),
    "decode_1_long_window_split4": (
        Case(query_lens=(1,), seq_lens=(4000,), block_size=16, **GPT_OSS_HEADS),
        128,
        4,
    ),
    "decode_1_long_full_split": (
        Case(query_lens=(1,), seq_lens=(4000,), block_size=16, **GPT_OSS_HEADS),
        None,
        None,
    ),
    "decode_256_window": (_random_case(256, (), 2000, **GPT_OSS_HEADS), 128, None),
    "decode_256_full": (_random_case(256, (), 2000, **GPT_OSS_HEADS), None, None),
    "mixed_window": (_random_case(20, (1, 37, 300, 129), 4000, **GPT_OSS_HEADS), 128, None),
    "mixed_full": (_random_case(20, (1, 37, 300, 129), 4000, **GPT_OSS_HEADS), None, None),
}


@cuda_test
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case_name", sorted(GPU_CASES))
def test_triton_kernel_with_window_and_sinks_matches_reference_on_cuda(
    case_name: str, dtype: torch.dtype, with_sinks: bool
) -> None:
    base_case, window, num_kv_splits = GPU_CASES[case_name]
    if window is None and not with_sinks:
        pytest.skip("the plain path is tested in test_paged_attention.py")
    case = dataclasses.replace(base_case, dtype=dtype, num_padding_tokens=5)
    inputs = _inputs(case, device="cuda")
    sinks = _sinks(case.num_heads, "cuda") if with_sinks else None
    scale = case.head_dim**-0.5
    expected = paged_attention_ref(**inputs, scale=scale, sliding_window=window, sinks=sinks)
    out = paged_attention_triton(
        **inputs, scale=scale, max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens), num_kv_splits=num_kv_splits,
        sliding_window=window, sinks=sinks,
    )  # fmt: skip
    num_real = sum(case.query_lens)
    tolerance = {torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(out[:num_real], expected[:num_real], rtol=tolerance, atol=tolerance)


@cuda_test
@pytest.mark.parametrize("num_decodes,num_kv_splits", [(256, None), (1, 4)])
def test_windowed_decode_with_sinks_replays_in_a_cuda_graph(
    num_decodes: int, num_kv_splits: int | None
) -> None:
    base_case = _random_case(num_decodes, (), 3000, **GPT_OSS_HEADS)
    case = dataclasses.replace(base_case, dtype=torch.bfloat16)
    inputs = _inputs(case, device="cuda")
    sinks = _sinks(case.num_heads, "cuda")
    scale = case.head_dim**-0.5

    def run() -> torch.Tensor:
        return paged_attention_triton(
            **inputs, scale=scale, max_query_len=1, max_seq_len=3000,
            num_kv_splits=num_kv_splits, sliding_window=128, sinks=sinks,
        )  # fmt: skip

    run()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run()
    new_lens = torch.randint(1, max(case.seq_lens) + 1, (num_decodes,), generator=None)
    inputs["seq_lens"].copy_(new_lens.to(device="cuda", dtype=torch.int32))
    inputs["query"].normal_()
    sinks.copy_(sinks.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    expected = paged_attention_ref(**inputs, scale=scale, sliding_window=128, sinks=sinks)
    torch.testing.assert_close(graph_out, expected, rtol=2e-2, atol=2e-2)
