"""The engine core on the embedded model: the same tokens over ZMQ as in process, a warm-up
through the real step loop that leaves nothing behind, utility calls answered over the
protocol, and a front end that comes back told how many requests its predecessor left."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.core.engine_core import EngineCore
from actors.core.engine_startup import reuse_engine
from actors.frontend.engine_client import EngineClient
from actors.inprocess_engine import InProcessEngine
from actors.protocol.launch_secret import new_secret
from actors.protocol.messages import (
    ClientHello,
    EngineCoreOutputs,
    EngineRequest,
    PredecessorAborted,
    UtilityCall,
    UtilityResult,
)
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.transport import (
    InProcessChannel,
    ZmqClientEndpoint,
    ZmqCoreEndpoint,
    ipc_address,
)
from app.tokenizer_loader import load_tokenizer
from tests.app._server_fixtures import ENGINE, shared_model

pytestmark = pytest.mark.slow

CONFIG = ENGINE.replace(max_num_seqs=8, max_num_batched_tokens=64)
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 170)), [7] * 20]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.8, seed=11, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(42,)),
]


def _requests() -> list[EngineRequest]:
    eos = load_tokenizer(CONFIG.model).eos_token_ids
    return [
        EngineRequest(f"r{i}", tuple(prompt), params, time.monotonic(), eos_token_ids=eos)
        for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS))
    ]


async def _generate(client: EngineClient) -> list[tuple[tuple[int, ...], str | None]]:
    streams = [client.add_request(request) for request in _requests()]
    deltas = [await stream.wait_finished() for stream in streams]
    return [(d.token_ids, d.finish_reason) for d in deltas if d is not None]


def test_zmq_and_in_process_transports_give_identical_tokens(tmp_path: Path) -> None:
    loaded = reuse_engine(shared_model(), CONFIG)
    tokenizer = load_tokenizer(CONFIG.model)

    async def in_process() -> list[tuple[tuple[int, ...], str | None]]:
        engine = InProcessEngine(loaded.worker, loaded.runner, CONFIG, tokenizer=tokenizer)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            outputs = await _generate(engine.client)
            engine.stop()
        return outputs

    async def over_zmq() -> list[tuple[tuple[int, ...], str | None]]:
        address = ipc_address(str(tmp_path))
        secret = new_secret()
        core = EngineCore(loaded.worker, loaded.runner, ZmqCoreEndpoint(address, secret), CONFIG)
        client = EngineClient(ZmqClientEndpoint(address, 0, secret), tokenizer)
        async with anyio.create_task_group() as tg:
            await tg.start(core.run)
            await tg.start(client.run)
            with anyio.fail_after(60):
                while client.ready is None:
                    await anyio.sleep(0.01)
                outputs = await _generate(client)
            core.stop()
            client.close()
            core.endpoint.close()
        return outputs

    expected = anyio.run(in_process)
    assert len(expected) == 3 and all(len(tokens) > 0 for tokens, _ in expected)
    assert anyio.run(over_zmq) == expected


def test_warm_up_runs_every_wave_through_the_step_loop_and_leaves_nothing() -> None:
    loaded = reuse_engine(shared_model(), CONFIG)

    async def run() -> None:
        engine = InProcessEngine(loaded.worker, loaded.runner, CONFIG, warm_up=True)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)  # started = warm and ready
            steps = engine.recent_step_stats()
            assert any(s.num_reqs == 1 for s in steps)  # batch-1 decode
            assert max(s.num_reqs for s in steps) == CONFIG.max_num_seqs  # a full batch
            assert any(s.num_tokens == CONFIG.max_num_batched_tokens for s in steps)  # chunks
            stats = (await engine.client.call("stats")).stats
            assert stats is not None and (stats.num_running, stats.num_waiting) == (0, 0)
            assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
            assert (await engine.client.call("check_kv_invariants")).error is None
            assert (await engine.client.call("nonsense")).error == "unknown method 'nonsense'"
            engine.stop()

    anyio.run(run)


def test_a_front_end_back_under_its_index_hears_how_many_requests_were_aborted() -> None:
    """A killed API server's successor says hello under the same index: the core aborts
    what the dead process left running and tells the successor how many, once."""
    loaded = reuse_engine(shared_model(), CONFIG)
    long_running = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run() -> None:
        channel = InProcessChannel(num_clients=2, roundtrip=True)
        core = EngineCore(loaded.worker, loaded.runner, channel.core, CONFIG)
        front_end = channel.clients[1]
        async with anyio.create_task_group() as tg:
            await tg.start(core.run)
            front_end.send(ClientHello(1))
            orphans = {f"orphan-{i}" for i in range(3)}
            for request_id in sorted(orphans):
                front_end.send(
                    EngineRequest(
                        request_id, (1, 2, 3), long_running, time.monotonic(), client_index=1
                    )
                )
            running: set[str] = set()
            with anyio.fail_after(60):
                while running != orphans:  # each one has produced a token
                    message = await front_end.receive()
                    if isinstance(message, EngineCoreOutputs):
                        running.update(message.request_ids)
                front_end.send(ClientHello(1))  # the successor
                told = [m for m in await _messages_until_stats(front_end) if _is_told(m)]
            assert told == [PredecessorAborted(num_requests=3)]
            stats = (await _messages_until_stats(front_end))[-1].stats
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            front_end.send(ClientHello(1))  # nothing left behind: nothing to tell
            assert not any(_is_told(m) for m in await _messages_until_stats(front_end))
            core.stop()

    anyio.run(run)


def _is_told(message: object) -> bool:
    return isinstance(message, PredecessorAborted)


async def _messages_until_stats(front_end: Any) -> list[Any]:
    """What the core sends front end 1 up to the answer to a stats call made now (the core
    handles a front end's messages in order, so earlier ones have been acted on)."""
    front_end.send(UtilityCall(0, "stats", client_index=1))
    received = []
    with anyio.fail_after(30):
        while not received or not isinstance(received[-1], UtilityResult):
            received.append(await front_end.receive())
    return received
