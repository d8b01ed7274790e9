"""SamplingState: normalisation, uploads, penalty state, tables and errors (CPU device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.protocol.sampling_params import SamplingParams, SamplingParamsError
from gpu.sampling.state import SamplingState

VOCAB = 50


def _state(**rows: SamplingParams) -> SamplingState:
    state = SamplingState(max_num_reqs=8, vocab_size=VOCAB, device="cpu")
    for name, params in rows.items():
        state.add_request(int(name[1:]), params, [1, 2, 2], [], eos_token_ids=[0], default_seed=77)
    return state


def test_parameters_are_normalised() -> None:
    state = _state(
        r0=SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1),
        r1=SamplingParams(temperature=1e-7, seed=3),
        r2=SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.2),
        r3=SamplingParams(top_k=VOCAB),
        r4=SamplingParams(top_k=12),
    )
    assert state.temperature_np[:5].tolist() == pytest.approx([0.0, 0.0, 0.5, 1.0, 1.0])
    assert state.top_k_np[:5].tolist() == [0, 0, 0, 0, 12]  # greedy, off, off, >= vocab: off
    assert state.top_p_np[:3].tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert state.min_p_np[:3].tolist() == pytest.approx([0.0, 0.0, 0.2])


def test_seeds_keep_their_low_64_bits_and_default_when_missing() -> None:
    state = _state(
        r0=SamplingParams(seed=2**64 - 1),
        r1=SamplingParams(seed=-5),
        r2=SamplingParams(),
        r3=SamplingParams(seed=2**63),
    )
    assert state.seed_np[:4].tolist() == [-1, -5, 77, -(2**63)]


def test_flush_uploads_changes_and_only_changes() -> None:
    state = _state()
    state.flush_to_device()
    state.add_request(2, SamplingParams(temperature=0.3, top_k=4), [], [], [0], default_seed=0)
    assert state.temperature_gpu[2].item() == 1.0  # not uploaded yet
    state.flush_to_device()
    assert state.temperature_gpu[2].item() == pytest.approx(0.3)
    assert state.top_k_gpu[2].item() == 4
    state.temperature_np[2] = 9.0  # written behind the state's back: not a tracked change
    state.flush_to_device()
    assert state.temperature_gpu[2].item() == pytest.approx(0.3)
    state.remove_request(2)
    state.flush_to_device()
    assert state.temperature_gpu[2].item() == 1.0 and state.top_k_gpu[2].item() == 0


def test_penalty_state_is_lazy_and_rebuilt_from_the_token_history() -> None:
    state = _state(r0=SamplingParams())
    state.flush_to_device()
    assert state.prompt_mask_gpu is None and state.output_counts_gpu is None
    state.add_request(
        3,
        SamplingParams(frequency_penalty=1.0),
        prompt_token_ids=[4, 4, 9],
        output_token_ids=[7, 7, 8],
        eos_token_ids=[0],
        default_seed=0,
    )
    state.flush_to_device()
    assert state.prompt_mask_gpu is not None and state.output_counts_gpu is not None
    assert torch.nonzero(state.prompt_mask_gpu[3]).flatten().tolist() == [4, 9]
    assert state.output_counts_gpu[3, [7, 8]].tolist() == [2, 1]
    assert state.output_counts_gpu[3].sum().item() == 3

    rows = torch.tensor([3, 3, 0], dtype=torch.int32)
    state.record_sampled(rows, torch.tensor([8, 8, 1]), torch.tensor([True, False, True]))
    assert state.output_counts_gpu[3, 8].item() == 2

    state.add_request(3, SamplingParams(presence_penalty=1.0), [5], [6], [0], default_seed=0)
    state.flush_to_device()  # re-added (e.g. after preemption): rebuilt from scratch
    assert torch.nonzero(state.prompt_mask_gpu[3]).flatten().tolist() == [5]
    assert torch.nonzero(state.output_counts_gpu[3]).flatten().tolist() == [6]
    assert state.uses_penalties_np[[0, 3]].tolist() == [False, True]


def test_logit_bias_and_stop_ids_fill_the_tables_and_grow_them() -> None:
    state = _state(
        r1=SamplingParams(logit_bias=((3, 1.0), (4, -2.0), (3, 5.0))),
        r2=SamplingParams(min_tokens=2, stop_token_ids=(9, 0, 9)),
        r3=SamplingParams(min_tokens=2, stop_token_ids=(9,), ignore_eos=True),
        r4=SamplingParams(stop_token_ids=(9,)),
    )
    assert state.num_logit_bias_np[1] == 2  # a repeated token keeps its last value
    state.add_request(
        5, SamplingParams(logit_bias=tuple((t, 0.5) for t in range(20))), [], [], [0], 0
    )
    state.flush_to_device()
    assert state.logit_bias_token_ids_gpu.shape[1] >= 20
    assert state.logit_bias_token_ids_gpu[1, :2].tolist() == [3, 4]  # kept across the growth
    assert state.logit_bias_values_gpu[1, :2].tolist() == [5.0, -2.0]
    assert state.logit_bias_token_ids_gpu[5, :20].tolist() == list(range(20))
    assert state.stop_token_ids_gpu[2, : state.num_stop_token_ids_np[2]].tolist() == [0, 9]
    assert state.stop_token_ids_gpu[3, : state.num_stop_token_ids_np[3]].tolist() == [9]
    assert state.min_tokens_np[[2, 3, 4]].tolist() == [2, 2, 0]


def test_bad_requests_are_rejected_with_the_parameter_named() -> None:
    state = _state()
    with pytest.raises(SamplingParamsError, match="outside the vocabulary") as error:
        state.add_request(0, SamplingParams(logit_bias=((VOCAB, 1.0),)), [], [], [0], 0)
    assert error.value.param == "logit_bias"
    with pytest.raises(SamplingParamsError) as error:
        state.add_request(0, SamplingParams(stop_token_ids=(-1,)), [], [], [0], 0)
    assert error.value.param == "stop_token_ids"
    with pytest.raises(ValueError, match="row must be an int in"):
        state.add_request(8, SamplingParams(), [], [], [0], 0)
    with pytest.raises(ValueError, match="prompt_token_ids must be in"):
        state.add_request(0, SamplingParams(repetition_penalty=1.5), [VOCAB + 3], [], [0], 0)
    assert state.repetition_penalty_np[0] == 1.0 and not state.uses_penalties_np[0]  # untouched
    with pytest.raises(ValueError, match="max_num_reqs"):
        SamplingState(0, VOCAB, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_uploads_and_penalty_rebuilds_match_the_numpy_mirrors() -> None:
    state = SamplingState(max_num_reqs=16, vocab_size=VOCAB, device="cuda")
    for row in range(16):
        state.add_request(
            row,
            SamplingParams(temperature=row / 10, seed=row, repetition_penalty=1.1),
            [row, row + 1],
            [row + 2] * row,
            eos_token_ids=[0],
            default_seed=0,
        )
    state.flush_to_device()
    torch.cuda.synchronize()
    assert np.allclose(state.temperature_gpu.cpu().numpy(), state.temperature_np)
    assert np.array_equal(state.seed_gpu.cpu().numpy(), state.seed_np)
    assert state.output_counts_gpu is not None
    assert state.output_counts_gpu.sum(dim=1).tolist() == list(range(16))
