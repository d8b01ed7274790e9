"""staged_write and StagedWrites: hand-checked cases, the host-buffer rotation, argument
errors, Triton under the interpreter (in a subprocess) and on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.staged_write import StagedWrites, staged_write_ref, staged_write_triton
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)

NUM_INTERPRETED_CASES = 4


def _index(rows: list[int], starts: list[int], lens: list[int]) -> tuple[torch.Tensor, ...]:
    cu_lens = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64), cu_lens


def test_reference_scatters_ragged_writes() -> None:
    target = torch.zeros(3, 6)
    rows, starts, cu_lens = _index([2, 0, 2], [1, 4, 4], [2, 2, 1])
    staged_write_ref(target, rows, starts, cu_lens, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert target.tolist() == [
        [0, 0, 0, 0, 3, 4],
        [0, 0, 0, 0, 0, 0],
        [0, 1, 2, 0, 5, 0],
    ]


def test_staged_writes_apply_then_clear() -> None:
    token_ids = torch.full((4, 8), -1, dtype=torch.int32)
    writes = StagedWrites()
    writes.stage(3, 0, np.array([10, 11, 12], dtype=np.int64))  # prompt of a new request
    writes.stage(1, 5, np.array([7]))  # one more token for a running one
    writes.stage(2, 0, np.array([], dtype=np.int32))  # empty writes are dropped
    assert len(writes) == 2

    writes.apply(token_ids)

    assert len(writes) == 0
    expected = torch.full((4, 8), -1, dtype=torch.int32)
    expected[3, :3] = torch.tensor([10, 11, 12], dtype=torch.int32)
    expected[1, 5] = 7
    assert torch.equal(token_ids, expected)
    writes.apply(token_ids)  # nothing staged: a no-op
    assert torch.equal(token_ids, expected)


def test_host_buffers_rotate_so_recent_ones_are_never_refilled() -> None:
    target = torch.zeros(2, 4, dtype=torch.int32)
    writes = StagedWrites(num_host_buffers=3)
    filled = []
    for step in range(4):
        writes.stage(step % 2, 0, np.array([step + 1, step + 1]))
        writes.apply(target)
        filled.append(writes._pool[step % 3].contents_cpu)
    # Steps 0, 1 and 2 used three distinct buffers, each still holding its own values,
    # so a copy of step 0 still queued while steps 1 and 2 are staged reads step 0's data.
    assert len({t.data_ptr() for t in filled[:3]}) == 3
    assert filled[1][:2].tolist() == [2, 2] and filled[2][:2].tolist() == [3, 3]
    assert filled[3].data_ptr() == filled[0].data_ptr(), "step 3 reuses step 0's buffer"
    assert target.tolist() == [[3, 3, 0, 0], [4, 4, 0, 0]]


def test_float_target_and_growth_beyond_initial_buffer() -> None:
    target = torch.zeros(2, 1000)
    writes = StagedWrites()
    values = np.linspace(0.0, 1.0, 900, dtype=np.float32)
    writes.stage(1, 100, values)
    writes.apply(target)
    assert torch.equal(target[1, 100:], torch.from_numpy(values))
    assert target[0].count_nonzero() == 0 and target[1, :100].count_nonzero() == 0


@pytest.mark.parametrize(
    ("stage", "target", "message"),
    [
        ((4, 0, np.array([1])), torch.zeros(4, 4, dtype=torch.int32), "outside the target"),
        ((0, 3, np.array([1, 2])), torch.zeros(4, 4, dtype=torch.int32), "outside the target"),
        ((0, 0, np.array([1.5])), torch.zeros(4, 4, dtype=torch.int32), "cannot stage float64"),
        (
            (0, 0, np.array([1])),
            torch.zeros(4, 4, dtype=torch.bfloat16),
            "does not support target dtype",
        ),
        ((0, 0, np.array([1])), torch.zeros(4), "target must be 2-D"),
    ],
)
def test_apply_rejects_bad_writes_and_clears(
    stage: tuple, target: torch.Tensor, message: str
) -> None:
    writes = StagedWrites()
    writes.stage(*stage)
    with pytest.raises(ValueError, match=message):
        writes.apply(target)
    assert len(writes) == 0


def test_a_later_overlapping_write_wins() -> None:
    # A row freed and taken again before the staged writes are applied is written twice.
    target = torch.zeros(2, 4, dtype=torch.int32)
    writes = StagedWrites()
    writes.stage(1, 0, np.array([1, 2, 3]))
    writes.stage(0, 2, np.array([5]))
    writes.stage(1, 2, np.array([9, 8]))
    writes.stage(1, 1, np.array([7]))
    writes.apply(target)
    assert target.tolist() == [[0, 0, 5, 0], [1, 7, 9, 8]]


def test_stage_and_constructor_errors() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        StagedWrites(num_host_buffers=2)
    writes = StagedWrites()
    with pytest.raises(ValueError, match="1-D"):
        writes.stage(0, 0, np.zeros((2, 2)))
    with pytest.raises(ValueError, match="must be >= 0"):
        writes.stage(-1, 0, np.zeros(2))
    with pytest.raises(ValueError, match="contents must be 1-D torch.float32"):
        staged_write_ref(
            torch.zeros(2, 2), *_index([0], [0], [1]), torch.zeros(1, dtype=torch.int32)
        )


def _random_writes(seed: int, num_rows: int, row_len: int, num_writes: int, max_len: int):
    """Non-overlapping writes: each row gets at most one, at a random place."""
    gen = np.random.default_rng(seed)
    rows = gen.choice(num_rows, size=num_writes, replace=False)
    lens = gen.integers(1, max_len + 1, size=num_writes)
    starts = np.array([gen.integers(0, row_len - n + 1) for n in lens])
    values = [gen.integers(-(1 << 30), 1 << 30, size=n).astype(np.int32) for n in lens]
    return rows.tolist(), starts.tolist(), values


def _loop_oracle(
    target: torch.Tensor, rows: list[int], starts: list[int], values: list[np.ndarray]
):
    out = target.clone()
    for row, start, vals in zip(rows, starts, values):
        out[row, start : start + len(vals)] = torch.from_numpy(vals)
    return out


test_triton_matches_reference_under_interpreter = interpreted_test(
    __file__,
    "_interpreted_main",
    printed=f"interpreted staged_write matched in {NUM_INTERPRETED_CASES} cases",
)


def _interpreted_main() -> None:
    from kernels.staged_write import _staged_write_kernel

    assert_interpreted(_staged_write_kernel)
    for seed in range(NUM_INTERPRETED_CASES):
        # Writes longer than the kernel's 128-wide block exercise its inner loop.
        rows, starts, values = _random_writes(
            seed, num_rows=8, row_len=300, num_writes=5, max_len=300
        )
        target = torch.zeros(8, 300, dtype=torch.int32)
        expected = _loop_oracle(target, rows, starts, values)
        _, _, cu_lens = _index(rows, starts, [len(v) for v in values])
        staged_write_triton(
            target,
            torch.tensor(rows),
            torch.tensor(starts),
            cu_lens,
            torch.from_numpy(np.concatenate(values)),
        )
        assert torch.equal(target, expected), f"seed {seed}"
    print(f"interpreted staged_write matched in {NUM_INTERPRETED_CASES} cases")


@cuda_test
def test_staged_writes_on_cuda_match_loop_oracle_over_many_steps() -> None:
    target = torch.zeros(1024, 2048, dtype=torch.int32, device="cuda")
    expected = target.cpu()
    writes = StagedWrites(pin_memory=True)
    for step in range(8):  # more steps than buffers, without synchronising in between
        rows, starts, values = _random_writes(
            step, num_rows=1024, row_len=2048, num_writes=512, max_len=600
        )
        for row, start, vals in zip(rows, starts, values):
            writes.stage(row, start, vals)
        writes.apply(target)
        expected = _loop_oracle(expected, rows, starts, values)
    assert all(slot.contents_cpu.is_pinned() for slot in writes._pool)
    torch.testing.assert_close(target.cpu(), expected, rtol=0, atol=0)


@cuda_test
def test_triton_matches_reference_on_cuda_float32() -> None:
    rows, starts, values = _random_writes(
        0, num_rows=1024, row_len=2048, num_writes=512, max_len=2048
    )
    float_values = torch.from_numpy(np.concatenate(values).astype(np.float32)).cuda()
    _, _, cu_lens = _index(rows, starts, [len(v) for v in values])
    index = [torch.tensor(rows).cuda(), torch.tensor(starts).cuda(), cu_lens.cuda()]
    got = torch.zeros(1024, 2048, device="cuda")
    want = torch.zeros(1024, 2048, device="cuda")
    staged_write_triton(got, *index, float_values)
    staged_write_ref(want, *index, float_values)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
