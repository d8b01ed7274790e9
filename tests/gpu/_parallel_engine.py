"""What the tensor- and pipeline-parallel engine tests share: the engine options, the
prompts and sampling cases compared against one device, and process checks."""

from __future__ import annotations

import os

from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM

ENGINE_OPTIONS = dict(
    device="cpu",
    max_model_len=128,
    num_kv_blocks=48,
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=24,
)
"""A 24-token budget: the 30-token prompt is prefilled in chunks beside the others' decodes."""
PROMPTS = [[1, 5, 17, 30, 2], list(range(40, 70)), [7, 8, 9], [100, 3, 100, 3], [64] * 6]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SAMPLED = [
    SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=1.0, seed=4, top_p=0.8, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=5, top_k=5, max_tokens=10, ignore_eos=True, logprobs=0),
    SamplingParams(
        temperature=1.2,
        seed=6,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        max_tokens=10,
        ignore_eos=True,
    ),
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
]
DEAD_WITHIN_S = 20.0
HUNG_TIMEOUT_S = 3.0


def outputs(llm: LLM, vocab_size: int | None = None) -> list:
    """The first completion of each of PROMPTS, greedy then sampled (their token ids
    folded into `vocab_size` when given)."""
    prompts = PROMPTS if vocab_size is None else [[t % vocab_size for t in p] for p in PROMPTS]
    greedy = llm.generate(prompts, GREEDY)
    sampled = llm.generate(prompts, SAMPLED)
    return [o.outputs[0] for o in greedy + sampled]


def alive(pids: list[int | None]) -> list[int]:
    return [
        pid
        for pid in pids
        if pid is not None and os.path.exists(f"/proc/{pid}") and "zombie" not in status_of(pid)
    ]


def status_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:
        return "gone"
