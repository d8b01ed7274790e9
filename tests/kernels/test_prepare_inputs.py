"""prepare_inputs: hand-checked reference cases, a loop oracle, Triton under the interpreter
(in a subprocess, since TRITON_INTERPRET is read when a kernel is decorated) and on CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.prepare_inputs import (
    prepare_inputs,
    prepare_inputs_ref,
    prepare_inputs_triton,
)
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)

NUM_INTERPRETED_CASES = 6


def _history(num_rows: int, max_model_len: int) -> torch.Tensor:
    # token_ids[r, p] = 1000 * r + p, so every expected id can be written down by hand.
    rows = torch.arange(num_rows, dtype=torch.int32)[:, None] * 1000
    return (rows + torch.arange(max_model_len, dtype=torch.int32)).contiguous()


def _outputs(num_tokens_padded: int, num_reqs_padded: int, ids_dtype: torch.dtype = torch.int64):
    # Stale garbage from a previous step: padding must be overwritten with zeros.
    return (
        torch.full((num_tokens_padded,), 77, dtype=ids_dtype),
        torch.full((num_tokens_padded,), 77, dtype=torch.int64),
        torch.full((num_reqs_padded,), 77, dtype=torch.int32),
    )


def test_mixed_batch_decode_chunked_prefill_and_first_chunk() -> None:
    token_ids = _history(num_rows=6, max_model_len=16)
    num_computed = torch.tensor([4, 0, 0, 7, 0, 0], dtype=torch.int32)
    # b=0: decode of row 3; b=1 (mid-batch): row 0 continues a prefill at 4 for 3 tokens;
    # b=2: first 2-token chunk of row 5.
    idx_mapping = torch.tensor([3, 0, 5], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    input_ids, positions, seq_lens = _outputs(num_tokens_padded=8, num_reqs_padded=4)

    prepare_inputs_ref(
        idx_mapping,
        query_start_loc,
        token_ids,
        num_computed,
        input_ids,
        positions,
        seq_lens,
        num_reqs=3,
        num_tokens=6,
    )

    assert input_ids.tolist() == [3007, 4, 5, 6, 5000, 5001, 0, 0]
    assert positions.tolist() == [7, 4, 5, 6, 0, 1, 0, 0]
    assert seq_lens.tolist() == [8, 7, 2, 0]
    assert num_computed.tolist() == [4, 0, 0, 7, 0, 0], "inputs must not change the state"


def test_int32_input_ids_and_longer_idx_mapping_buffer() -> None:
    token_ids = _history(num_rows=3, max_model_len=8)
    num_computed = torch.tensor([2, 5, 0], dtype=torch.int32)
    idx_mapping = torch.tensor([1, 2, 99], dtype=torch.int32)  # entries past num_reqs are stale
    query_start_loc = torch.tensor([0, 1, 2, 50], dtype=torch.int32)
    input_ids, positions, seq_lens = _outputs(4, 3, ids_dtype=torch.int32)

    prepare_inputs(
        idx_mapping,
        query_start_loc,
        token_ids,
        num_computed,
        input_ids,
        positions,
        seq_lens,
        num_reqs=2,
        num_tokens=2,
    )

    assert input_ids.dtype == torch.int32
    assert input_ids.tolist() == [1005, 2000, 0, 0]
    assert positions.tolist() == [5, 0, 0, 0]
    assert seq_lens.tolist() == [6, 1, 0]


def test_empty_batch_only_zeroes_padding() -> None:
    token_ids = _history(2, 4)
    input_ids, positions, seq_lens = _outputs(5, 2)
    prepare_inputs_ref(
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        token_ids,
        torch.zeros(2, dtype=torch.int32),
        input_ids,
        positions,
        seq_lens,
        0,
        0,
    )
    assert (
        input_ids.tolist() == [0] * 5
        and positions.tolist() == [0] * 5
        and seq_lens.tolist() == [0, 0]
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"positions_out": torch.zeros(8, dtype=torch.int32)}, "positions_out must be torch.int64"),
        ({"seq_lens_out": torch.zeros(2, dtype=torch.int32)}, "seq_lens_out has 2 entries"),
        ({"input_ids_out": torch.zeros(8, dtype=torch.float32)}, "input_ids_out must be"),
        ({"num_tokens": 9}, "must hold num_tokens"),
        ({"token_ids": torch.zeros(16, dtype=torch.int32)}, "token_ids must be 2-D"),
        ({"query_start_loc": torch.zeros(3, dtype=torch.int32)}, "query_start_loc"),
    ],
)
def test_bad_arguments_raise_clear_errors(change: dict, message: str) -> None:
    args = {
        "idx_mapping": torch.zeros(3, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        "token_ids": torch.zeros(4, 8, dtype=torch.int32),
        "num_computed_tokens": torch.zeros(4, dtype=torch.int32),
        "input_ids_out": torch.zeros(8, dtype=torch.int64),
        "positions_out": torch.zeros(8, dtype=torch.int64),
        "seq_lens_out": torch.zeros(4, dtype=torch.int32),
        "num_reqs": 3,
        "num_tokens": 3,
    }
    args.update(change)
    with pytest.raises(ValueError, match=message):
        prepare_inputs(**args)


@dataclass(frozen=True, slots=True)
class _Case:
    idx_mapping: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    token_ids: torch.Tensor  # [num_rows, max_model_len] int32
    num_computed_tokens: torch.Tensor  # [num_rows] int32
    num_reqs: int
    num_tokens: int


def _random_case(
    seed: int,
    num_rows: int,
    max_model_len: int,
    num_reqs: int,
    max_query_len: int,
    device: str = "cpu",
) -> _Case:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(num_rows, generator=gen)[:num_reqs]
    query_lens = torch.randint(1, max_query_len + 1, (num_reqs,), generator=gen)
    query_lens[: num_reqs // 2] = 1  # half decode rows
    num_computed = torch.randint(0, max_model_len, (num_rows,), generator=gen)
    num_computed[rows] = torch.minimum(num_computed[rows], max_model_len - query_lens)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    token_ids = torch.randint(
        0, 1 << 30, (num_rows, max_model_len), generator=gen, dtype=torch.int32
    )
    return _Case(
        rows.to(device, torch.int32),
        query_start_loc.to(device, torch.int32),
        token_ids.to(device),
        num_computed.to(device, torch.int32),
        num_reqs,
        int(query_start_loc[-1]),
    )


def _run(
    impl,
    case: _Case,
    num_tokens_padded: int,
    num_reqs_padded: int,
    ids_dtype: torch.dtype = torch.int64,
) -> list[torch.Tensor]:
    device = case.idx_mapping.device
    outputs = [t.to(device) for t in _outputs(num_tokens_padded, num_reqs_padded, ids_dtype)]
    impl(
        case.idx_mapping,
        case.query_start_loc,
        case.token_ids,
        case.num_computed_tokens,
        *outputs,
        case.num_reqs,
        case.num_tokens,
    )
    return outputs


def _loop_oracle(case: _Case, num_tokens_padded: int, num_reqs_padded: int) -> list[list[int]]:
    input_ids, positions, seq_lens = (
        [0] * num_tokens_padded,
        [0] * num_tokens_padded,
        [0] * num_reqs_padded,
    )
    qs = case.query_start_loc.tolist()
    for b, row in enumerate(case.idx_mapping.tolist()):
        computed = int(case.num_computed_tokens[row])
        for i in range(qs[b], qs[b + 1]):
            pos = computed + i - qs[b]
            input_ids[i], positions[i] = int(case.token_ids[row, pos]), pos
        seq_lens[b] = computed + qs[b + 1] - qs[b]
    return [input_ids, positions, seq_lens]


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_loop_oracle_on_random_batches(seed: int) -> None:
    case = _random_case(seed, num_rows=16, max_model_len=40, num_reqs=7, max_query_len=12)
    outputs = _run(prepare_inputs_ref, case, case.num_tokens + 5, 9)
    assert [t.tolist() for t in outputs] == _loop_oracle(case, case.num_tokens + 5, 9)


test_triton_matches_reference_under_interpreter = interpreted_test(
    __file__,
    "_interpreted_main",
    printed=f"interpreted prepare_inputs matched in {NUM_INTERPRETED_CASES} cases",
)


def _interpreted_main() -> None:
    from kernels.prepare_inputs import _prepare_inputs_kernel

    assert_interpreted(_prepare_inputs_kernel)
    for seed in range(NUM_INTERPRETED_CASES):
        # Queries longer than the kernel's 256-token block exercise its inner loop.
        case = _random_case(seed, num_rows=12, max_model_len=600, num_reqs=5, max_query_len=300)
        padded = (case.num_tokens + 3, 8)
        triton_out = _run(prepare_inputs_triton, case, *padded)
        assert [t.tolist() for t in triton_out] == _loop_oracle(case, *padded), f"seed {seed}"
    print(f"interpreted prepare_inputs matched in {NUM_INTERPRETED_CASES} cases")


@cuda_test
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_triton_matches_reference_on_cuda(ids_dtype: torch.dtype) -> None:
    case = _random_case(
        0, num_rows=1024, max_model_len=2048, num_reqs=512, max_query_len=64, device="cuda"
    )
    padded = (case.num_tokens + 100, 640)
    results = [
        _run(impl, case, *padded, ids_dtype=ids_dtype)
        for impl in (prepare_inputs_triton, prepare_inputs_ref)
    ]
    for triton_out, ref_out in zip(*results):
        torch.testing.assert_close(triton_out, ref_out, rtol=0, atol=0)


@cuda_test
def test_triton_reads_pinned_host_history_through_uva() -> None:
    case = _random_case(
        1, num_rows=1024, max_model_len=2048, num_reqs=512, max_query_len=16, device="cuda"
    )
    pinned = _Case(
        case.idx_mapping,
        case.query_start_loc,
        case.token_ids.cpu().pin_memory(),
        case.num_computed_tokens,
        case.num_reqs,
        case.num_tokens,
    )
    padded = (case.num_tokens, 512)
    for got, want in zip(
        _run(prepare_inputs_triton, pinned, *padded), _run(prepare_inputs_ref, case, *padded)
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
