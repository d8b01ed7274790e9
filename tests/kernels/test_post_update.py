"""post_update: hand-checked reference cases, the hand-off to the next step's prepare_inputs,
a loop oracle, Triton under the interpreter (in a subprocess) and on CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.post_update import post_update, post_update_ref, post_update_triton
from kernels.prepare_inputs import prepare_inputs
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)

NUM_INTERPRETED_CASES = 5


@dataclass(slots=True)
class _State:
    num_computed_tokens: torch.Tensor  # [num_rows] int32
    total_len: torch.Tensor  # [num_rows] int32
    token_ids: torch.Tensor  # [num_rows, max_model_len] int32
    last_sampled: torch.Tensor  # [num_rows] int64

    def clone(self) -> _State:
        return _State(
            *(
                t.clone()
                for t in (
                    self.num_computed_tokens,
                    self.total_len,
                    self.token_ids,
                    self.last_sampled,
                )
            )
        )


def _hand_state() -> _State:
    # row 0: 10-token prompt, nothing computed; row 1: idle; row 2: decoding, 6 tokens known
    # and 5 computed; row 3: 10-token prompt with 4 computed.
    return _State(
        num_computed_tokens=torch.tensor([0, 3, 5, 4], dtype=torch.int32),
        total_len=torch.tensor([10, 3, 6, 10], dtype=torch.int32),
        token_ids=torch.zeros(4, 12, dtype=torch.int32),
        last_sampled=torch.full((4,), -1, dtype=torch.int64),
    )


def _apply(
    impl, state: _State, idx_mapping: list[int], query_lens: list[int], sampled: list[int]
) -> None:
    device = state.total_len.device
    query_start_loc = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
    )
    impl(
        torch.tensor(idx_mapping, dtype=torch.int32, device=device),
        query_start_loc.to(device),
        torch.tensor(sampled, dtype=torch.int64, device=device),
        state.num_computed_tokens,
        state.total_len,
        state.token_ids,
        state.last_sampled,
        len(idx_mapping),
    )


def test_decode_partial_chunk_and_final_chunk() -> None:
    state = _hand_state()
    # b=0 decodes row 2; b=1 (mid-batch) runs a partial 4-token chunk of row 0;
    # b=2 runs the final 6-token chunk of row 3.
    _apply(
        post_update_ref, state, idx_mapping=[2, 0, 3], query_lens=[1, 4, 6], sampled=[101, 102, 103]
    )

    assert state.num_computed_tokens.tolist() == [4, 3, 6, 10]
    assert state.total_len.tolist() == [10, 3, 7, 11]
    assert state.last_sampled.tolist() == [-1, -1, 101, 103]
    expected_tokens = torch.zeros(4, 12, dtype=torch.int32)
    expected_tokens[2, 6] = 101
    expected_tokens[3, 10] = 103
    assert torch.equal(state.token_ids, expected_tokens), (
        "the partial chunk's sample must be dropped"
    )


def test_next_decode_step_reads_the_sampled_token_from_history() -> None:
    state = _hand_state()
    _apply(post_update, state, idx_mapping=[2], query_lens=[1], sampled=[151_000])
    input_ids = torch.zeros(1, dtype=torch.int64)
    positions = torch.zeros(1, dtype=torch.int64)
    seq_lens = torch.zeros(1, dtype=torch.int32)
    prepare_inputs(
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        state.token_ids,
        state.num_computed_tokens,
        input_ids,
        positions,
        seq_lens,
        1,
        1,
    )
    assert (input_ids.item(), positions.item(), seq_lens.item()) == (151_000, 6, 7)


def test_sample_past_max_model_len_is_not_stored() -> None:
    state = _State(
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int32),
        torch.zeros(1, 4, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int64),
    )
    _apply(post_update, state, [0], [1], [9])
    assert state.token_ids.tolist() == [[0, 0, 0, 0]]
    assert (state.total_len.item(), state.last_sampled.item()) == (5, 9)


def test_bad_arguments_raise_clear_errors() -> None:
    state = _hand_state()
    args = [
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32),
        state.num_computed_tokens,
        state.total_len,
        state.token_ids,
        state.last_sampled,
        1,
    ]
    with pytest.raises(ValueError, match="sampled_token_ids must be torch.int64"):
        post_update(*args)
    args[2] = torch.tensor([5], dtype=torch.int64)
    args[4] = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="one entry per request row"):
        post_update(*args)
    args[4] = state.total_len
    with pytest.raises(ValueError, match="num_reqs"):
        post_update(*args[:-1], 2)


def _random_step(seed: int, num_rows: int, max_model_len: int, num_reqs: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    total_len = torch.randint(1, max_model_len, (num_rows,), generator=gen, dtype=torch.int32)
    computed = (torch.rand(num_rows, generator=gen) * total_len).to(torch.int32)  # < total_len
    state = _State(
        computed,
        total_len,
        torch.randint(0, 1000, (num_rows, max_model_len), generator=gen, dtype=torch.int32),
        torch.full((num_rows,), -1, dtype=torch.int64),
    )
    rows = torch.randperm(num_rows, generator=gen)[:num_reqs]
    remaining = (total_len - computed)[rows]
    # Mostly chunks that finish the known tokens; some stop short (partial prefill).
    partial = torch.rand(num_reqs, generator=gen) < 0.3
    query_lens = torch.where(partial & (remaining > 1), remaining - 1, remaining)
    sampled = torch.randint(0, 200_000, (num_reqs,), generator=gen).tolist()
    state = _State(
        *(
            t.to(device)
            for t in (
                state.num_computed_tokens,
                state.total_len,
                state.token_ids,
                state.last_sampled,
            )
        )
    )
    return state, rows.tolist(), query_lens.tolist(), sampled


def _loop_oracle(
    state: _State, rows: list[int], query_lens: list[int], sampled: list[int]
) -> _State:
    out = state.clone()
    for row, query_len, token in zip(rows, query_lens, sampled):
        out.num_computed_tokens[row] += query_len
        total = int(out.total_len[row])
        if out.num_computed_tokens[row] >= total:
            if total < out.token_ids.shape[1]:
                out.token_ids[row, total] = token
            out.total_len[row] = total + 1
            out.last_sampled[row] = token
    return out


def _assert_same_state(got: _State, want: _State) -> None:
    for name in ("num_computed_tokens", "total_len", "token_ids", "last_sampled"):
        torch.testing.assert_close(
            getattr(got, name), getattr(want, name), rtol=0, atol=0, msg=name
        )


@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_loop_oracle_on_random_batches(seed: int) -> None:
    state, rows, query_lens, sampled = _random_step(seed, num_rows=20, max_model_len=16, num_reqs=9)
    want = _loop_oracle(state, rows, query_lens, sampled)
    _apply(post_update_ref, state, rows, query_lens, sampled)
    _assert_same_state(state, want)


test_triton_matches_reference_under_interpreter = interpreted_test(
    __file__,
    "_interpreted_main",
    printed=f"interpreted post_update matched in {NUM_INTERPRETED_CASES} cases",
)


def _interpreted_main() -> None:
    from kernels.post_update import _post_update_kernel

    assert_interpreted(_post_update_kernel)
    for seed in range(NUM_INTERPRETED_CASES):
        state, rows, query_lens, sampled = _random_step(
            seed, num_rows=10, max_model_len=12, num_reqs=6
        )
        want = _loop_oracle(state, rows, query_lens, sampled)
        _apply(post_update_triton, state, rows, query_lens, sampled)
        _assert_same_state(state, want)
    print(f"interpreted post_update matched in {NUM_INTERPRETED_CASES} cases")


@cuda_test
def test_triton_matches_reference_on_cuda() -> None:
    state, rows, query_lens, sampled = _random_step(
        0, num_rows=1024, max_model_len=2048, num_reqs=512, device="cuda"
    )
    ref_state = state.clone()
    _apply(post_update_triton, state, rows, query_lens, sampled)
    _apply(post_update_ref, ref_state, rows, query_lens, sampled)
    _assert_same_state(state, ref_state)
