"""The Sampler on the CPU with its fast paths (kernels/_gumbel_cpu.py, _threshold_cpu.py,
penalties' sparse path) against the same Sampler on the torch references: the same
tokens, logprobs and ranks, bit for bit, over a batch that mixes every option."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.gumbel_sample as gumbel_module
import kernels.penalties as penalties_module
import kernels.sampling_thresholds as thresholds_module
from actors.protocol.sampling_params import SamplingParams
from gpu.sampling.sampler import Sampler, SamplerOutput
from gpu.sampling.state import SamplingState

VOCAB = 4096
EOS = 7
PARAMS = [
    SamplingParams(),  # the storm's: temperature 1, nothing else
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=11, top_k=40),
    SamplingParams(temperature=0.6, top_p=0.9),
    SamplingParams(top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.3, min_p=0.1, seed=3),
    SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
    SamplingParams(frequency_penalty=-0.4, seed=5),
    SamplingParams(logit_bias=((3, 5.0), (9, -100.0)), min_tokens=4, stop_token_ids=(11,)),
    SamplingParams(temperature=0.9, logprobs=5, repetition_penalty=0.9, top_k=5),
]


def _sampler() -> Sampler:
    state = SamplingState(max_num_reqs=16, vocab_size=VOCAB, device="cpu")
    generator = torch.Generator().manual_seed(1)
    for row, params in enumerate(PARAMS):
        prompt = torch.randint(0, VOCAB, (2000,), generator=generator).tolist()  # half seen
        output = torch.randint(0, VOCAB, (row,), generator=generator).tolist()
        state.add_request(row, params, prompt, output, [EOS], default_seed=100 + row)
    return Sampler(state)


def _steps(sampler: Sampler, num_steps: int) -> list[SamplerOutput]:
    generator = torch.Generator().manual_seed(2)
    rows = np.asarray([*range(len(PARAMS)), 2, 6, 0], dtype=np.int32)  # some rows twice
    outputs = []
    for step in range(num_steps):
        logits = torch.randn(rows.size, VOCAB, generator=generator) * 4
        logits[:, ::97] = 0.0
        positions = torch.arange(rows.size, dtype=torch.int64) + 30 + step
        out = sampler(
            logits,
            torch.from_numpy(rows),
            rows,
            positions,
            torch.full((rows.size,), step, dtype=torch.int32),
            5,
        )
        sampler.state.record_sampled(
            torch.from_numpy(rows), out.sampled_token_ids, torch.ones(rows.size, dtype=torch.bool)
        )
        outputs.append(out)
    return outputs


def test_fast_cpu_paths_sample_what_the_references_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = _steps(_sampler(), num_steps=6)
    monkeypatch.setattr(gumbel_module, "gumbel_sample_cpu", gumbel_module.gumbel_sample_ref)
    monkeypatch.setattr(
        thresholds_module, "sampling_thresholds_cpu", thresholds_module.sampling_thresholds_ref
    )
    monkeypatch.setattr(
        penalties_module, "apply_penalties_cpu", penalties_module.apply_penalties_ref
    )
    reference = _steps(_sampler(), num_steps=6)
    for got, expected in zip(fast, reference, strict=True):
        assert torch.equal(got.sampled_token_ids, expected.sampled_token_ids)
        assert got.logprobs is not None and expected.logprobs is not None
        assert torch.equal(got.logprob_token_ids, expected.logprob_token_ids)
        assert torch.equal(got.logprobs.view(torch.int32), expected.logprobs.view(torch.int32))
        assert torch.equal(got.sampled_ranks, expected.sampled_ranks)
    assert len({tuple(out.sampled_token_ids.tolist()) for out in fast}) == 6  # draws move on
