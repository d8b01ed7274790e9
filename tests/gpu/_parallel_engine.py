"""What the tensor- and pipeline-parallel engine tests share: the engine options, the
prompts and sampling cases compared against one device, and process checks."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio
import pytest
import torch

from actors.core.engine_startup import LoadedEngine
from actors.inprocess_engine import InProcessEngine
from actors.protocol.messages import EngineRequest
from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from gpu.distributed.group import file_rendezvous
from gpu.distributed.launch import start_workers

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


NCCL = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    ],
)
"""The device parameter of a test that also runs over NCCL where two GPUs exist."""


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


def run_ranks(
    tmp_path: Any, target: Any, world_size: int, *args: Any, timeout_s: float = 180.0
) -> list[Any]:
    """`target(rank, world_size, init_method, *args)` on `world_size` spawned ranks; their
    return values in rank order."""
    init_method = file_rendezvous(str(tmp_path))
    with start_workers(target, world_size, (world_size, init_method, *args)) as workers:
        return workers.wait(timeout_s)


def kill_rank_mid_generation(loaded: LoadedEngine, pid: int) -> tuple[str | None, float, str]:
    """Start a long greedy request on `loaded`'s engine, kill `pid` (a spawned rank) once
    the first token is out, and wait for the engine to be declared dead. Returns the
    request's finish reason, the seconds from the kill to both, and the death reason."""
    dead_reasons: list[str] = []

    async def run() -> tuple[str | None, float]:
        engine = InProcessEngine(
            loaded.worker, loaded.runner, loaded.config, on_dead=dead_reasons.append
        )
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            long_greedy = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
            stream = engine.add_request(
                EngineRequest("long", tuple(PROMPTS[0]), long_greedy, time.monotonic())
            )
            first = await stream.get()
            assert first is not None and first.token_ids
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with anyio.fail_after(DEAD_WITHIN_S):
                final = await stream.wait_finished()
                while not dead_reasons:
                    await anyio.sleep(0.05)
            engine.stop()
        return (None if final is None else final.finish_reason), time.monotonic() - killed_at

    try:
        finish_reason, elapsed_s = anyio.run(run)
    finally:
        loaded.worker.close()
    return finish_reason, elapsed_s, dead_reasons[0]
