"""gather_block_table and compute_slot_mapping: hand-checked reference cases, a loop oracle,
Triton under the interpreter (in a subprocess) and on CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.slot_mapping import (
    compute_slot_mapping,
    compute_slot_mapping_ref,
    compute_slot_mapping_triton,
    gather_block_table,
    gather_block_table_ref,
    gather_block_table_triton,
)
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)

NUM_INTERPRETED_CASES = 5


def test_gather_copies_scheduled_rows_and_zeroes_padding_rows() -> None:
    # block_table[r, c] = 10 * r + c
    block_table = torch.arange(5, dtype=torch.int32)[:, None] * 10 + torch.arange(
        4, dtype=torch.int32
    )
    block_table_out = torch.full((5, 4), 77, dtype=torch.int32)
    gather_block_table_ref(
        torch.tensor([4, 1, 2], dtype=torch.int32), block_table, block_table_out, 3
    )
    assert block_table_out.tolist() == [
        [40, 41, 42, 43],
        [10, 11, 12, 13],
        [20, 21, 22, 23],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
    ]


def test_slot_mapping_for_decode_chunked_prefill_and_first_chunk() -> None:
    block_size = 4
    block_table_out = torch.tensor(
        [[7, 3, 0, 0], [2, 9, 5, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32
    )
    # b=0 decodes position 5; b=1 (mid-batch) runs positions 3..6 across a block boundary;
    # b=2 runs its first two positions.
    query_start_loc = torch.tensor([0, 1, 5, 7], dtype=torch.int32)
    positions = torch.tensor([5, 3, 4, 5, 6, 0, 1, 0, 0], dtype=torch.int64)
    slot_mapping = torch.full((9,), 77, dtype=torch.int64)

    compute_slot_mapping_ref(
        query_start_loc, positions, block_table_out, block_size, slot_mapping, 3, 7
    )

    assert slot_mapping.tolist() == [
        3 * 4 + 1,
        2 * 4 + 3,
        9 * 4 + 0,
        9 * 4 + 1,
        9 * 4 + 2,
        4,
        5,
        -1,
        -1,
    ]


def test_dispatchers_run_on_cpu_tensors() -> None:
    block_table = torch.tensor([[5, 6], [8, 9]], dtype=torch.int32)
    block_table_out = torch.full((3, 2), 77, dtype=torch.int32)
    gather_block_table(torch.tensor([1], dtype=torch.int32), block_table, block_table_out, 1)
    slot_mapping = torch.zeros(3, dtype=torch.int64)
    compute_slot_mapping(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([15, 16, 0]),
        block_table_out,
        16,
        slot_mapping,
        1,
        2,
    )
    assert block_table_out.tolist() == [[8, 9], [0, 0], [0, 0]]
    assert slot_mapping.tolist() == [8 * 16 + 15, 9 * 16, -1]


def test_bad_arguments_raise_clear_errors() -> None:
    block_table = torch.zeros(4, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table_out has 2 columns"):
        gather_block_table(
            torch.zeros(2, dtype=torch.int32), block_table, torch.zeros(2, 2, dtype=torch.int32), 2
        )
    with pytest.raises(ValueError, match="idx_mapping must be torch.int32"):
        gather_block_table(
            torch.zeros(2, dtype=torch.int64), block_table, torch.zeros(2, 3, dtype=torch.int32), 2
        )
    with pytest.raises(ValueError, match="num_reqs"):
        gather_block_table(
            torch.zeros(2, dtype=torch.int32), block_table, torch.zeros(2, 3, dtype=torch.int32), 3
        )
    query_start_loc = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size must be positive"):
        compute_slot_mapping(
            query_start_loc,
            torch.zeros(2, dtype=torch.int64),
            block_table,
            0,
            torch.zeros(2, dtype=torch.int64),
            1,
            2,
        )
    with pytest.raises(ValueError, match="slot_mapping_out must be torch.int64"):
        compute_slot_mapping(
            query_start_loc,
            torch.zeros(2, dtype=torch.int64),
            block_table,
            16,
            torch.zeros(2, dtype=torch.int32),
            1,
            2,
        )
    with pytest.raises(ValueError, match="num_tokens"):
        compute_slot_mapping(
            query_start_loc,
            torch.zeros(2, dtype=torch.int64),
            block_table,
            16,
            torch.zeros(1, dtype=torch.int64),
            1,
            2,
        )


@dataclass(frozen=True, slots=True)
class _Case:
    idx_mapping: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    positions: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_rows, max_blocks] int32
    block_size: int
    num_reqs: int
    num_tokens: int


def _random_case(
    seed: int,
    num_rows: int,
    max_blocks: int,
    block_size: int,
    num_reqs: int,
    max_query_len: int,
    device: str = "cpu",
) -> _Case:
    gen = torch.Generator().manual_seed(seed)
    max_model_len = max_blocks * block_size
    rows = torch.randperm(num_rows, generator=gen)[:num_reqs]
    query_lens = torch.randint(1, max_query_len + 1, (num_reqs,), generator=gen)
    query_lens[: num_reqs // 2] = 1
    starts = (torch.rand(num_reqs, generator=gen) * (max_model_len - query_lens + 1)).long()
    positions = torch.cat(
        [torch.arange(s, s + q) for s, q in zip(starts.tolist(), query_lens.tolist())]
    )
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    block_table = torch.randint(
        0, 1 << 20, (num_rows, max_blocks), generator=gen, dtype=torch.int32
    )
    return _Case(
        rows.to(device, torch.int32),
        query_start_loc.to(device, torch.int32),
        positions.to(device),
        block_table.to(device),
        block_size,
        num_reqs,
        positions.shape[0],
    )


def _run(gather, slots, case: _Case, num_reqs_padded: int, num_tokens_padded: int):
    device = case.block_table.device
    block_table_out = torch.full(
        (num_reqs_padded, case.block_table.shape[1]), 77, dtype=torch.int32, device=device
    )
    slot_mapping = torch.full((num_tokens_padded,), 77, dtype=torch.int64, device=device)
    gather(case.idx_mapping, case.block_table, block_table_out, case.num_reqs)
    slots(
        case.query_start_loc,
        case.positions,
        block_table_out,
        case.block_size,
        slot_mapping,
        case.num_reqs,
        case.num_tokens,
    )
    return block_table_out, slot_mapping


def _loop_oracle(case: _Case, num_reqs_padded: int, num_tokens_padded: int):
    max_blocks = case.block_table.shape[1]
    table = [[0] * max_blocks for _ in range(num_reqs_padded)]
    slots = [-1] * num_tokens_padded
    qs = case.query_start_loc.tolist()
    for b, row in enumerate(case.idx_mapping.tolist()):
        table[b] = case.block_table[row].tolist()
        for i in range(qs[b], qs[b + 1]):
            pos = int(case.positions[i])
            slots[i] = table[b][pos // case.block_size] * case.block_size + pos % case.block_size
    return table, slots


@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_loop_oracle_on_random_batches(seed: int) -> None:
    case = _random_case(seed, num_rows=12, max_blocks=6, block_size=4, num_reqs=5, max_query_len=10)
    table, slots = _run(
        gather_block_table_ref, compute_slot_mapping_ref, case, 8, case.num_tokens + 4
    )
    assert (table.tolist(), slots.tolist()) == _loop_oracle(case, 8, case.num_tokens + 4)


test_triton_matches_reference_under_interpreter = interpreted_test(
    __file__,
    "_interpreted_main",
    printed=f"interpreted slot_mapping matched in {NUM_INTERPRETED_CASES} cases",
)


def _interpreted_main() -> None:
    from kernels.slot_mapping import (
        _compute_slot_mapping_kernel,
        _gather_block_table_kernel,
    )

    assert_interpreted(_compute_slot_mapping_kernel, _gather_block_table_kernel)
    for seed in range(NUM_INTERPRETED_CASES):
        # 300 blocks per row and queries up to 300 tokens exercise the 256-wide inner loops.
        case = _random_case(
            seed, num_rows=10, max_blocks=300, block_size=2, num_reqs=4, max_query_len=300
        )
        padded = (6, case.num_tokens + 3)
        table, slots = _run(gather_block_table_triton, compute_slot_mapping_triton, case, *padded)
        assert (table.tolist(), slots.tolist()) == _loop_oracle(case, *padded), f"seed {seed}"
    print(f"interpreted slot_mapping matched in {NUM_INTERPRETED_CASES} cases")


@cuda_test
@pytest.mark.parametrize("block_size", [16, 64])
def test_triton_matches_reference_on_cuda(block_size: int) -> None:
    case = _random_case(
        0,
        num_rows=1024,
        max_blocks=2048 // block_size,
        block_size=block_size,
        num_reqs=512,
        max_query_len=64,
        device="cuda",
    )
    padded = (640, case.num_tokens + 100)
    got = _run(gather_block_table_triton, compute_slot_mapping_triton, case, *padded)
    want = _run(gather_block_table_ref, compute_slot_mapping_ref, case, *padded)
    for got_tensor, want_tensor in zip(got, want):
        torch.testing.assert_close(got_tensor, want_tensor, rtol=0, atol=0)
