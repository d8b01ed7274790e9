"""Input prep and post_update with device-side step counts, as inside a CUDA graph: the
launch covers padded bounds, the real counts come from a device tensor, and the result
must equal an exact-count launch (the rows and tokens past the real counts are padding)."""

from __future__ import annotations

import pytest
import torch

from kernels.post_update import post_update_ref, post_update_triton
from kernels.prepare_inputs import prepare_inputs_ref, prepare_inputs_triton
from kernels.slot_mapping import (
    compute_slot_mapping_ref,
    compute_slot_mapping_triton,
    gather_block_table_ref,
    gather_block_table_triton,
)
from tests.kernels import test_post_update as post_cases
from tests.kernels import test_prepare_inputs as prep_cases
from tests.kernels import test_slot_mapping as slot_cases
from tests.kernels._triton_interpreter import triton_vs_reference_tests

EXTRA_REQS, EXTRA_TOKENS = 3, 7


def _padded_qsl(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    pad = torch.full((EXTRA_REQS,), num_tokens, dtype=torch.int32, device=query_start_loc.device)
    return torch.cat([query_start_loc, pad])


def _counts(num_reqs: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([num_reqs, num_tokens], dtype=torch.int32, device=device)


def _check_prepare_inputs(impl, seed: int, device: str) -> None:
    case = prep_cases._random_case(
        seed, num_rows=12, max_model_len=300, num_reqs=5, max_query_len=40, device=device
    )
    bound_reqs, bound_tokens = case.num_reqs + EXTRA_REQS, case.num_tokens + EXTRA_TOKENS
    exact = prep_cases._run(prepare_inputs_ref, case, bound_tokens, bound_reqs)
    outputs = [t.to(device) for t in prep_cases._outputs(bound_tokens, bound_reqs)]
    idx = torch.cat([case.idx_mapping, torch.zeros(EXTRA_REQS, dtype=torch.int32, device=device)])
    impl(
        idx,
        _padded_qsl(case.query_start_loc, case.num_tokens),
        case.token_ids,
        case.num_computed_tokens,
        *outputs,
        bound_reqs,
        bound_tokens,
        step_counts=_counts(case.num_reqs, case.num_tokens, case.idx_mapping.device),
    )
    for got, want in zip(outputs, exact):
        assert torch.equal(got, want)


def _check_slot_mapping(gather, slots, seed: int, device: str) -> None:
    case = slot_cases._random_case(
        seed, num_rows=10, max_blocks=40, block_size=4, num_reqs=4, max_query_len=30, device=device
    )
    bound_reqs, bound_tokens = case.num_reqs + EXTRA_REQS, case.num_tokens + EXTRA_TOKENS
    want_table, want_slots = slot_cases._run(
        gather_block_table_ref, compute_slot_mapping_ref, case, bound_reqs, bound_tokens
    )
    table = torch.full_like(want_table, 77)
    slot_mapping = torch.full_like(want_slots, 77)
    counts = _counts(case.num_reqs, case.num_tokens, case.block_table.device)
    idx = torch.cat([case.idx_mapping, torch.zeros(EXTRA_REQS, dtype=torch.int32, device=device)])
    positions = torch.cat(
        [case.positions, torch.zeros(EXTRA_TOKENS, dtype=torch.int64, device=device)]
    )
    gather(idx, case.block_table, table, bound_reqs, step_counts=counts)
    slots(
        _padded_qsl(case.query_start_loc, case.num_tokens),
        positions,
        table,
        case.block_size,
        slot_mapping,
        bound_reqs,
        bound_tokens,
        step_counts=counts,
    )
    assert torch.equal(table, want_table) and torch.equal(slot_mapping, want_slots)


def _check_post_update(impl, seed: int, device: str) -> None:
    state, rows, query_lens, sampled = post_cases._random_step(
        seed, num_rows=12, max_model_len=16, num_reqs=6, device=device
    )
    want = post_cases._loop_oracle(state, rows, query_lens, sampled)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    # Padding rows name real rows on purpose: they must not be touched.
    idx = torch.tensor(rows + rows[:EXTRA_REQS], dtype=torch.int32, device=device)
    tokens = torch.tensor(sampled + [9] * EXTRA_REQS, dtype=torch.int64, device=device)
    impl(
        idx,
        _padded_qsl(qsl.to(device), num_tokens),
        tokens,
        state.num_computed_tokens,
        state.total_len,
        state.token_ids,
        state.last_sampled,
        len(rows) + EXTRA_REQS,
        step_counts=_counts(len(rows), num_tokens, torch.device(device)),
    )
    post_cases._assert_same_state(state, want)


@pytest.mark.parametrize("seed", range(3))
def test_references_with_step_counts_match_exact_launches(seed: int) -> None:
    _check_prepare_inputs(prepare_inputs_ref, seed, "cpu")
    _check_slot_mapping(gather_block_table_ref, compute_slot_mapping_ref, seed, "cpu")
    _check_post_update(post_update_ref, seed, "cpu")


def test_counts_beyond_the_bounds_are_refused() -> None:
    case = prep_cases._random_case(0, num_rows=4, max_model_len=20, num_reqs=2, max_query_len=3)
    outputs = prep_cases._outputs(case.num_tokens, 2)
    with pytest.raises(ValueError, match="exceed the bounds"):
        prepare_inputs_ref(
            case.idx_mapping,
            case.query_start_loc,
            case.token_ids,
            case.num_computed_tokens,
            *outputs,
            2,
            case.num_tokens,
            step_counts=_counts(3, case.num_tokens, torch.device("cpu")),
        )


def _compare(num_seeds: int, device: str) -> None:
    for seed in range(num_seeds):
        _check_prepare_inputs(prepare_inputs_triton, seed, device)
        _check_slot_mapping(gather_block_table_triton, compute_slot_mapping_triton, seed, device)
        _check_post_update(post_update_triton, seed, device)


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_seeds": 3, "device": "cpu"},
        on_cuda={"num_seeds": 3, "device": "cuda"},
    )
)
