"""The Sampler on CUDA: the same tokens and logprobs as on the CPU over a batch that mixes
the options, and the greedy and temperature-only paths well under a millisecond."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.protocol.sampling_params import SamplingParams
from tests.gpu._sampler_cases import _logits, _run, _sampler

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _mixed_params() -> dict[int, SamplingParams]:
    return {
        0: SamplingParams(temperature=0.0),
        1: SamplingParams(temperature=0.8, seed=1),
        2: SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=2),
        3: SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, seed=3),
        4: SamplingParams(
            temperature=1.3,
            frequency_penalty=0.5,
            logit_bias=((17, 3.0),),
            min_tokens=4,
            stop_token_ids=(11,),
            seed=4,
            logprobs=5,
        ),
    }


@pytest.mark.gpu
@requires_cuda
def test_cuda_sampler_matches_the_cpu_sampler() -> None:
    vocab_size, num_rows = 4096, 64
    outputs = {3: [5, 6, 6], 4: [100, 100]}
    cpu = _sampler(_mixed_params(), vocab_size=vocab_size, outputs=outputs)
    cuda = _sampler(_mixed_params(), vocab_size=vocab_size, device="cuda", outputs=outputs)
    rows = np.arange(num_rows) % 5
    logits = _logits(num_rows, vocab_size, scale=3.0)
    num_output = (np.arange(num_rows) % 7).tolist()
    expected = _run(cpu, logits, rows, range(num_rows), num_output, max_num_logprobs=5)
    actual = _run(cuda, logits, rows, range(num_rows), num_output, max_num_logprobs=5)
    assert torch.equal(actual.sampled_token_ids.cpu(), expected.sampled_token_ids)
    assert actual.logprob_token_ids is not None and actual.logprobs is not None
    assert torch.equal(actual.logprob_token_ids.cpu(), expected.logprob_token_ids)
    torch.testing.assert_close(actual.logprobs.cpu(), expected.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_greedy_and_temperature_paths_take_well_under_a_millisecond(
    temperature: float,
) -> None:
    import triton.testing

    num_rows, vocab_size = 256, 151936
    sampler = _sampler(
        {row: SamplingParams(temperature=temperature, seed=row) for row in range(32)},
        vocab_size=vocab_size,
        device="cuda",
    )
    rows = np.arange(num_rows, dtype=np.int32) % 32
    logits = torch.randn(num_rows, vocab_size, device="cuda")
    rows_gpu = torch.from_numpy(rows).cuda()
    positions = torch.arange(num_rows, device="cuda")
    num_output = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
    milliseconds = triton.testing.do_bench(
        lambda: sampler(logits, rows_gpu, rows, positions, num_output, None)
    )
    assert milliseconds < 1.0
