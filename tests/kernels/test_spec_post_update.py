"""spec_post_update: a hand-checked speculative step, its reduction to post_update without
drafts, and Triton against the reference (interpreter and CUDA)."""

from __future__ import annotations

import torch

from kernels.post_update import post_update_ref
from kernels.spec_post_update import (
    spec_post_update,
    spec_post_update_ref,
    spec_post_update_triton,
)
from tests.kernels._triton_interpreter import triton_vs_reference_tests


def _state(device: str = "cpu") -> dict[str, torch.Tensor]:
    # row 0: decoding, 6 known and 5 computed; row 1: a 10-token prompt with 4 computed;
    # row 2: decoding, 8 known and 7 computed, 2 columns left before max_model_len.
    return {
        "num_computed_tokens": torch.tensor([5, 4, 7], dtype=torch.int32, device=device),
        "total_len": torch.tensor([6, 10, 8], dtype=torch.int32, device=device),
        "token_ids": torch.arange(30, dtype=torch.int32, device=device).view(3, 10),
        "last_sampled": torch.full((3,), -1, dtype=torch.int64, device=device),
    }


def _step(
    impl,
    state: dict[str, torch.Tensor],
    query_lens: list[int],
    slots: list[int],
    output: list[list[int]],
    accepted: list[int],
) -> None:
    device = state["total_len"].device
    query_start_loc = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    impl(
        torch.arange(len(query_lens), dtype=torch.int32, device=device),
        query_start_loc,
        torch.tensor(slots, dtype=torch.int32, device=device),
        torch.tensor(output, dtype=torch.int64, device=device),
        torch.tensor(accepted, dtype=torch.int32, device=device),
        state["num_computed_tokens"],
        state["total_len"],
        state["token_ids"],
        state["last_sampled"],
    )


def test_rows_take_their_accepted_drafts_plus_one_and_roll_back_the_rest() -> None:
    state = _state()
    # row 0: 3 slots, 1 accepted -> tokens 70, 71; row 1: a prefill chunk of 3 (no sample);
    # row 2: 3 slots, all accepted -> 4 tokens, of which only 2 fit the row.
    _step(
        spec_post_update_ref,
        state,
        [4, 3, 4],
        [3, 0, 3],
        [[70, 71, -1, -1], [99, -1, -1, -1], [80, 81, 82, 83]],
        [1, 0, 3],
    )
    assert state["num_computed_tokens"].tolist() == [5 + 4 - 2, 7, 7 + 4]
    assert state["total_len"].tolist() == [8, 10, 12]
    assert state["token_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 70, 71, 8, 9]
    assert state["token_ids"][1].tolist() == list(range(10, 20))
    assert state["token_ids"][2].tolist() == [20, 21, 22, 23, 24, 25, 26, 27, 80, 81]
    assert state["last_sampled"].tolist() == [71, -1, 83]


def test_without_drafts_it_is_post_update() -> None:
    spec, plain = _state(), _state()
    _step(spec_post_update_ref, spec, [1, 6, 1], [0, 0, 0], [[7], [8], [9]], [0, 0, 0])
    post_update_ref(
        torch.arange(3, dtype=torch.int32),
        torch.tensor([0, 1, 7, 8], dtype=torch.int32),
        torch.tensor([7, 8, 9]),
        plain["num_computed_tokens"],
        plain["total_len"],
        plain["token_ids"],
        plain["last_sampled"],
        num_reqs=3,
    )
    for name in spec:
        assert torch.equal(spec[name], plain[name]), name


def compare_triton_to_reference(num_reqs: int, k: int, device: str) -> None:
    generator = torch.Generator().manual_seed(num_reqs * 31 + k)
    max_num_reqs, max_model_len = num_reqs + 3, 40
    rows = torch.randperm(max_num_reqs, generator=generator)[:num_reqs].to(torch.int32)
    total = torch.randint(
        2, max_model_len - 1, (max_num_reqs,), generator=generator, dtype=torch.int32
    )
    decoding = torch.rand(max_num_reqs, generator=generator) < 0.7
    computed = torch.where(decoding, total - 1, (total - 5).clamp(min=0)).to(torch.int32)
    slots = torch.where(
        decoding[rows.long()], torch.randint(0, k + 1, (num_reqs,), generator=generator), 0
    ).to(torch.int32)
    prefill_lens = torch.randint(1, 6, (num_reqs,), generator=generator)
    query_lens = torch.where(decoding[rows.long()], 1 + slots, prefill_lens)
    accepted = (
        (torch.rand(num_reqs, generator=generator) * (slots + 1).float()).long().to(torch.int32)
    )
    output = torch.randint(0, 50, (num_reqs, k + 1), generator=generator)
    output = torch.where(torch.arange(k + 1)[None, :] <= accepted[:, None].long(), output, -1)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).to(
        torch.int32
    )
    base = {
        "num_computed_tokens": computed,
        "total_len": total,
        "token_ids": torch.randint(
            0, 50, (max_num_reqs, max_model_len), generator=generator, dtype=torch.int32
        ),
        "last_sampled": torch.full((max_num_reqs,), -1, dtype=torch.int64),
    }
    results = []
    for impl in (spec_post_update_ref, spec_post_update_triton):
        state = {name: t.clone().to(device) for name, t in base.items()}
        impl(
            rows.to(device),
            query_start_loc.to(device),
            slots.to(device),
            output.to(device),
            accepted.to(device),
            *state.values(),
        )
        results.append(state)
    for name in base:
        assert torch.equal(results[0][name].cpu(), results[1][name].cpu()), name


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        compare_triton_to_reference,
        interpreted={"num_reqs": 6, "k": 3, "device": "cpu"},
        on_cuda={"num_reqs": 200, "k": 5, "device": "cuda"},
    )
)


def test_dispatcher_runs_the_reference_off_cuda() -> None:
    state = _state()
    _step(spec_post_update, state, [2, 1, 1], [1, 0, 0], [[3, 4], [5, -1], [6, -1]], [1, 0, 0])
    assert state["total_len"].tolist() == [8, 10, 9]


def compare_padded_to_unpadded(impl_name: str, device: str) -> None:
    """A batch padded with entries naming a real row, under step_counts, updates exactly
    what the unpadded batch does."""
    impl = {"ref": spec_post_update_ref, "triton": spec_post_update_triton}[impl_name]
    padded, plain = _state(device), _state(device)
    _step(
        impl,
        plain,
        [4, 3, 4],
        [3, 0, 3],
        [[70, 71, -1, -1], [99, -1, -1, -1], [80, 81, 82, 83]],
        [1, 0, 3],
    )
    # Two padding entries name row 0 (a real row of the step), with no tokens and no slots.
    query_start_loc = torch.tensor([0, 4, 7, 11, 11, 11], dtype=torch.int32, device=device)
    impl(
        torch.tensor([0, 1, 2, 0, 0], dtype=torch.int32, device=device),
        query_start_loc,
        torch.tensor([3, 0, 3, 0, 0], dtype=torch.int32, device=device),
        torch.tensor(
            [
                [70, 71, -1, -1],
                [99, -1, -1, -1],
                [80, 81, 82, 83],
                [5, -1, -1, -1],
                [6, -1, -1, -1],
            ],
            dtype=torch.int64,
            device=device,
        ),
        torch.tensor([1, 0, 3, 0, 0], dtype=torch.int32, device=device),
        padded["num_computed_tokens"],
        padded["total_len"],
        padded["token_ids"],
        padded["last_sampled"],
        step_counts=torch.tensor([3, 11], dtype=torch.int32, device=device),
    )
    for name in plain:
        assert torch.equal(padded[name].cpu(), plain[name].cpu()), name


def test_padding_entries_past_step_counts_change_nothing() -> None:
    compare_padded_to_unpadded("ref", "cpu")


test_triton_padding_in_interpreter, test_triton_padding_on_cuda = triton_vs_reference_tests(
    compare_padded_to_unpadded,
    interpreted={"impl_name": "triton", "device": "cpu"},
    on_cuda={"impl_name": "triton", "device": "cuda"},
)
