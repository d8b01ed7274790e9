"""The tensor-parallel engine on CPU: rank 0 in this process, the other ranks spawned, gloo.

- TP = 2 gives the greedy tokens of TP = 1 in float32 on tiny llama and qwen3
  checkpoints (sharded safetensors), with chunked prefill next to decodes (and over NCCL
  on two GPUs, with CUDA graphs, where they exist);
- seeded temperature / top-k / top-p / penalties give the same tokens, and logprobs the
  same values, as one device;
- killing a rank's process mid-generation, or stopping it (a hung rank: the group's
  collective timeout), fails the running requests and declares the engine dead within a
  bounded time; no worker process outlives the engine.
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

from actors.core.engine_startup import choose_runner, load_engine
from actors.inprocess_engine import InProcessEngine
from actors.protocol.config import EngineConfig
from actors.protocol.messages import EngineRequest
from actors.protocol.sampling_params import SamplingParams
from app.llm import LLM
from gpu.distributed.tp_engine import ParallelRunner, load_tp_worker
from gpu.distributed.tp_leader import TPFailedError
from gpu.platform import probe_platform
from tests._embedded_model import needs_embedded_model
from tests.gpu._parallel_engine import (
    DEAD_WITHIN_S,
    ENGINE_OPTIONS,
    GREEDY,
    HUNG_TIMEOUT_S,
    NCCL,
    PROMPTS,
    alive,
    kill_rank_mid_generation,
    outputs,
)
from tests.gpu._tiny_checkpoints import save_sharded, tiny_hf_model

pytestmark = pytest.mark.usefixtures("ranks_wait_passively")


@pytest.mark.parametrize("device", ["cpu", NCCL])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_tp2_engine_gives_the_tokens_and_logprobs_of_one_device(
    tmp_path, architecture, device
) -> None:
    # On CUDA the TP 2 engine runs its forward in CUDA graphs with the all-reduces captured.
    save_sharded(tiny_hf_model(architecture), str(tmp_path))
    options = {**ENGINE_OPTIONS, "device": device, "dtype": "float32"}
    single = outputs(LLM(str(tmp_path), **options))
    with LLM(str(tmp_path), tensor_parallel_size=2, **options) as llm:
        assert llm.runner == "v2"
        pids = llm.worker.tp_leader.workers.pids
        assert len(alive(pids)) == 1
        sharded = outputs(llm)
    assert alive(pids) == []  # close() leaves no worker behind
    assert len({t for o in single for t in o.token_ids}) > 5, "a degenerate continuation"
    for one, tp in zip(single, sharded, strict=True):
        assert tp.token_ids == one.token_ids
        assert (tp.logprobs is None) == (one.logprobs is None)
        for tp_entry, one_entry in zip(tp.logprobs or (), one.logprobs or (), strict=True):
            assert tp_entry.token_id == one_entry.token_id and tp_entry.rank == one_entry.rank
            assert tp_entry.logprob == pytest.approx(one_entry.logprob, abs=1e-4)
            assert [t.token_id for t in tp_entry.top_logprobs] == [
                t.token_id for t in one_entry.top_logprobs
            ]


@pytest.mark.slow
@needs_embedded_model
def test_tp3_engine_on_the_embedded_model_gives_the_greedy_tokens_of_one_device() -> None:
    # SmolLM2-135M has 9 query and 3 KV heads: TP 3 is the size that divides them.
    prompts = ["The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # quantization none: one device would pack the Q4_1 projections, TP ranks do not
    options = dict(device="cpu", quantization="none", max_model_len=128, num_kv_blocks=32)
    single = LLM("default", **options).generate(prompts, params)
    with LLM("default", tensor_parallel_size=3, **options) as llm:
        sharded = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in single]


def test_a_hung_rank_fails_the_engine_after_the_group_timeout(tmp_path) -> None:
    save_sharded(tiny_hf_model("llama"), str(tmp_path))
    config = EngineConfig(
        model=str(tmp_path),
        tensor_parallel_size=2,
        distributed_timeout_s=HUNG_TIMEOUT_S,
        **ENGINE_OPTIONS,
    )
    platform = probe_platform("cpu")
    worker = load_tp_worker(config, platform)  # --distributed-timeout-seconds
    runner = choose_runner(config, platform, worker.model_config)
    pids = worker.tp_leader.workers.pids
    dead_reasons: list[str] = []

    async def run() -> tuple[str | None, float]:
        engine = InProcessEngine(worker, runner, config, on_dead=dead_reasons.append)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            os.kill(pids[0], signal.SIGSTOP)  # alive, but never answers a collective
            stopped_at = time.monotonic()
            stream = engine.add_request(
                EngineRequest("hung", tuple(PROMPTS[0]), GREEDY, time.monotonic())
            )
            with anyio.fail_after(DEAD_WITHIN_S):
                final = await stream.wait_finished()
                while not dead_reasons:
                    await anyio.sleep(0.05)
            dead_after_s = time.monotonic() - stopped_at
            engine.stop()
        return (None if final is None else final.finish_reason), dead_after_s

    try:
        finish_reason, dead_after_s = anyio.run(run)
    finally:
        worker.close()
    assert finish_reason == "error"
    assert HUNG_TIMEOUT_S <= dead_after_s < DEAD_WITHIN_S
    assert "rank 0 failed a step" in dead_reasons[0], dead_reasons
    assert alive(pids) == []


def test_a_killed_rank_fails_its_requests_and_the_engine_within_bounded_time(tmp_path) -> None:
    save_sharded(tiny_hf_model("llama"), str(tmp_path))
    loaded = load_engine(
        EngineConfig(model=str(tmp_path), tensor_parallel_size=2, **ENGINE_OPTIONS)
    )
    pids = loaded.worker.tp_leader.workers.pids
    finish_reason, elapsed_s, dead_reason = kill_rank_mid_generation(loaded, pids[0])
    assert finish_reason == "error"
    assert "rank" in dead_reason, dead_reason
    assert elapsed_s < DEAD_WITHIN_S
    assert alive(pids) == []
    with pytest.raises(TPFailedError, match="rank 1"):  # no new engine on a broken group
        ParallelRunner(loaded.worker, loaded.config)
