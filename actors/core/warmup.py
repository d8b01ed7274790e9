"""Requests the engine core runs through its own step loop before it reports ready, so that
the first real requests pay no JIT compilation: every Triton kernel specialization a
serving mix needs (prefill and decode shapes, chunked prefill, every sampler path, logprobs,
penalties) is compiled by real steps, not by a side path."""

from __future__ import annotations

import time

import numpy as np

from actors.protocol.messages import EngineRequest
from actors.protocol.sampling_params import SamplingParams

WARMUP_CLIENT = -1
"""Outputs for this client index stay inside the engine core."""

_SAMPLER_PATHS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    SamplingParams(temperature=0.7, min_p=0.1),
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.9, logprobs=0),
    SamplingParams(
        temperature=0.7, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
    SamplingParams(temperature=0.0, logit_bias=((1, 2.0),)),
    SamplingParams(temperature=0.0, min_tokens=4),
)


def warmup_requests(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    vocab_size: int,
    seed: int = 0,
) -> list[list[EngineRequest]]:
    """Waves of requests, each run to its end before the next starts: single requests alone
    (batch-1 prefill and decode; prompt lengths that cover Triton's integer
    specializations: 1, a multiple of 16 and neither), then a mixed batch (every sampler
    path, assorted prompt lengths, staggered ends so the decode batch shrinks through many
    sizes), then one prompt longer than a step's token budget (chunked prefill) when the
    context allows it."""
    rng = np.random.default_rng(seed)
    now = time.monotonic()

    def request(
        name: str, prompt_len: int, max_tokens: int, params: SamplingParams = _SAMPLER_PATHS[0]
    ) -> EngineRequest:
        tokens = tuple(int(t) for t in rng.integers(0, vocab_size, prompt_len))
        return EngineRequest(
            f"warmup-{name}",
            tokens,
            params.replace(max_tokens=max_tokens, ignore_eos=True),
            now,
            client_index=WARMUP_CLIENT,
        )

    waves = [
        [request(f"single-{length}", length, 8)]
        for length in (1, 16, 17, 139)
        if length + 8 < max_model_len
    ]
    num_mixed = max(1, min(max_num_seqs, 64))
    prompt_cap = max(1, min(max_num_batched_tokens, max_model_len - 40) // num_mixed)
    waves.append(
        [
            request(
                f"mixed-{i}",
                1 + int(rng.integers(0, prompt_cap)),
                2 + i % 33,
                _SAMPLER_PATHS[i % len(_SAMPLER_PATHS)],
            )
            for i in range(num_mixed)
        ]
    )
    long_len = max_num_batched_tokens + 17
    if long_len + 4 < max_model_len:
        waves.append([request("chunked", long_len, 4)])
    return waves
