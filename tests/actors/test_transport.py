"""The protocol on the wire: every message survives the codec (numpy arrays without
per-element work), the ZMQ and in-process transports carry the same messages, and the
core's ZMQ endpoint serves only the peers that present the launch secret, whatever else
reaches its socket."""

from __future__ import annotations

import anyio
import msgspec
import numpy as np
import pytest
import structlog

from actors.protocol.codec import Codec
from actors.protocol.launch_secret import new_secret
from actors.protocol.messages import (
    AbortRequests,
    AdmittedRequest,
    ClientHello,
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    EngineRequest,
    EngineStartupFailed,
    GrammarVocab,
    Heartbeat,
    LogprobsArrays,
    PredecessorAborted,
    PrefixCacheReset,
    PromptLogprobs,
    RequestFinish,
    SchedulerStats,
    Shutdown,
    StepStats,
    UtilityCall,
    UtilityResult,
)
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutputSpec
from actors.protocol.transport import (
    InProcessChannel,
    TransportClosed,
    ZmqClientEndpoint,
    ZmqCoreEndpoint,
    ipc_address,
    send_shutdown,
)
from tests.actors._hostile_peer import send_hostile_frames

STATS = SchedulerStats(
    num_running=2,
    num_waiting=1,
    num_preemptions_total=3,
    num_total_kv_blocks=64,
    num_free_kv_blocks=10,
    kv_usage_perc=0.8,
    prefix_cache_queries_tokens=100,
    prefix_cache_hits_tokens=40,
    num_free_rows=None,
)
TO_CORE = [
    EngineRequest(
        "r1",
        (1, 2, 3),
        SamplingParams(
            temperature=0.5,
            top_k=4,
            stop=("x",),
            logit_bias=((3, -1.5),),
            seed=2**63,
            extra={"k": [1, "v"]},
        ),
        12.5,
        eos_token_ids=(0,),
        priority=-1,
        cache_salt="s",
        client_index=3,
        trace_context={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    ),
    AbortRequests(("r1", "r2")),
    ClientHello(2),
    UtilityCall(7, "stats", 1),
    Shutdown(),
    GrammarVocab('{"model": {"type": "BPE"}}', (2, 7)),
    EngineRequest(
        "r2",
        (4,),
        SamplingParams(
            prompt_logprobs=3,
            structured_output=(StructuredOutputSpec("json", '{"type":"object"}', strict=False)),
        ),
        1.0,
    ),
]
TO_FRONT_END = [
    EngineCoreOutputs(
        step_id=9,
        request_ids=("a", "b"),
        new_token_ids=np.array([5, 6], np.int32),
        num_new_tokens=np.array([1, 1], np.int32),
        logprobs=LogprobsArrays(
            np.array([[5, 1], [6, 2]], np.int64),
            np.array([[-0.1, -2.5], [-np.inf, np.nan]], np.float32),
            np.array([1, 3], np.int64),
        ),
        finished=(RequestFinish("a", "stop", 5), RequestFinish("c", "error", error="boom")),
        admitted=(AdmittedRequest("b", 16, 1.0, 2.0),),
        prompt_logprobs=PromptLogprobs(
            ("b",),
            np.array([1], np.int32),
            np.array([2], np.int32),
            LogprobsArrays(
                np.array([[7, 7], [8, 1]], np.int64),
                np.array([[-0.5, -0.5], [-3.0, -0.1]], np.float32),
                np.array([1, 4], np.int64),
            ),
        ),
        step_stats=StepStats(9, 2, 2, 0, 1e-4, 2e-4, 3e-3, 0.0),
        scheduler_stats=STATS,
    ),
    EngineCoreOutputs(step_id=-1, finished=(RequestFinish("z", "abort"),)),
    EngineReady(
        "dummy:qwen3-0.6b",
        "qwen3",
        4096,
        151936,
        16,
        100,
        1 << 20,
        256,
        "v2",
        "no fallback rule applies",
        "default",
        "cuda:0",
        9.5,
        123,
    ),
    EngineStartupFailed("model not found: /x", True),
    EngineDead("5 steps failed"),
    PredecessorAborted(3),
    UtilityResult(7, stats=STATS),
    UtilityResult(8, error="broken"),
    UtilityResult(9, prefix_cache_reset=PrefixCacheReset(5, 2)),
    Heartbeat(),
]


def _equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        )
    if hasattr(a, "__struct_fields__"):
        return type(a) is type(b) and all(
            _equal(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__
        )
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


@pytest.mark.parametrize("message", TO_CORE, ids=lambda m: type(m).__name__)
def test_every_message_to_the_core_round_trips(message: object) -> None:
    codec = Codec()
    assert _equal(codec.decode_to_core(codec.encode(message)), message)


@pytest.mark.parametrize("message", TO_FRONT_END, ids=lambda m: type(m).__name__)
def test_every_message_to_the_front_end_round_trips(message: object) -> None:
    codec = Codec()
    decoded = codec.decode_to_front_end(codec.encode(message))
    assert _equal(decoded, message)


def test_arrays_travel_as_one_blob_each() -> None:
    """A step's token array costs its raw bytes, not a msgpack integer per element."""
    codec = Codec()
    tokens = np.arange(1024, dtype=np.int32) + 100_000
    encoded = codec.encode(EngineCoreOutputs(1, new_token_ids=tokens))
    assert tokens.tobytes() in encoded
    assert len(encoded) < tokens.nbytes + 256  # field names and headers


def test_a_message_of_the_wrong_direction_is_refused() -> None:
    codec = Codec()
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'dead' - at `\\$.type`"):
        codec.decode_to_core(codec.encode(EngineDead("x")))


async def test_in_process_channel_routes_by_client_and_closes() -> None:
    channel = InProcessChannel(num_clients=2, roundtrip=True)
    channel.clients[1].send(ClientHello(1))
    assert _equal(await channel.core.receive(), ClientHello(1))
    channel.core.send(1, TO_FRONT_END[0])
    assert _equal(await channel.clients[1].receive(), TO_FRONT_END[0])
    channel.core.close()
    with pytest.raises(TransportClosed):
        await channel.clients[0].receive()


async def test_zmq_routes_answers_to_the_front_end_that_said_hello(tmp_path) -> None:
    address, secret = ipc_address(str(tmp_path)), new_secret()
    core = ZmqCoreEndpoint(address, secret)
    clients = [ZmqClientEndpoint(address, index, secret) for index in range(2)]
    try:
        for index, client in enumerate(clients):
            client.send(ClientHello(index))
            assert _equal(await core.receive(), ClientHello(index))
        for message in TO_CORE:
            clients[1].send(message)
            assert _equal(await core.receive(), message)
        core.send(1, TO_FRONT_END[0])
        core.send(0, TO_FRONT_END[2])
        assert _equal(await clients[1].receive(), TO_FRONT_END[0])
        assert _equal(await clients[0].receive(), TO_FRONT_END[2])
        core.send(5, EngineDead("nobody"))  # unknown front end: dropped, not raised
    finally:
        for endpoint in (core, *clients):
            endpoint.close()


# ---- hostile peers on the core's socket ----------------------------------------------


async def _receive_into(core: ZmqCoreEndpoint, received: list[object]) -> None:
    received.append(await core.receive())


def _dropped_lines(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [line for line in logs if line["event"] == "engine_socket_frame_dropped"]


async def test_the_core_endpoint_drops_what_an_unauthenticated_peer_sends(tmp_path) -> None:
    """Garbage, wrong shapes and forged hellos never reach the core or raise, and a forged
    hello for index 0 does not take the real front end 0's replies."""
    address, secret = ipc_address(str(tmp_path)), new_secret()
    core = ZmqCoreEndpoint(address, secret)
    client = ZmqClientEndpoint(address, 0, secret)
    try:
        client.send(ClientHello(0))
        assert _equal(await core.receive(), ClientHello(0))
        received: list[object] = []
        with structlog.testing.capture_logs() as logs, anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: _receive_into(core, received))
                send_hostile_frames(tmp_path / "engine.sock")
                while not _dropped_lines(logs):  # the flood has reached the core
                    await anyio.sleep(0.01)
                await anyio.sleep(0.2)
                client.send(AbortRequests(("real",)))
        assert len(received) == 1 and _equal(received[0], AbortRequests(("real",)))
        assert len(_dropped_lines(logs)) == 1  # a flood costs one line per interval
        assert core.client_indices == (0,)
        core.send(0, TO_FRONT_END[2])
        with anyio.fail_after(5):
            assert _equal(await client.receive(), TO_FRONT_END[2])
    finally:
        core.close()
        client.close()


async def test_an_authenticated_hello_takes_an_index_over_and_the_supervisor_only_speaks(
    tmp_path,
) -> None:
    """The supervisor restarts a dead API server: the new process's hello (with the secret)
    takes its index over. The supervisor's own hello (no index) reaches no one; its
    Shutdown does."""
    address, secret = ipc_address(str(tmp_path)), new_secret()
    core = ZmqCoreEndpoint(address, secret)
    first, restarted = (ZmqClientEndpoint(address, 1, secret) for _ in range(2))
    try:
        first.send(ClientHello(1))
        assert _equal(await core.receive(), ClientHello(1))
        restarted.send(ClientHello(1))
        assert _equal(await core.receive(), ClientHello(1))
        core.send(1, TO_FRONT_END[2])
        with anyio.fail_after(5):
            assert _equal(await restarted.receive(), TO_FRONT_END[2])
        first.send(AbortRequests(("from the old process",)))  # its peer lost its standing
        await anyio.sleep(0.2)
        send_shutdown(address, secret)
        with anyio.fail_after(5):
            assert _equal(await core.receive(), Shutdown())
        assert core.client_indices == (1,)
    finally:
        for endpoint in (core, first, restarted):
            endpoint.close()
