"""How protocol messages travel between the front ends and the engine core.

- ZMQ over an ipc socket when the core is its own process: the core binds a ROUTER, each
  front end connects a DEALER, so one socket pair carries both directions and the core
  answers each front end on its own identity. A front end authenticates with the launch's
  secret in its hello (actors/protocol/launch_secret.py); the core drops whatever else reaches the
  socket.
- In-process (tests, the offline `LLM`): both sides on one event loop, message objects
  passed as they are, or through the codec (`roundtrip=True`) to prove they serialize.

Either way the same typed messages (actors/protocol/messages.py) cross, one per request or per step.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from typing import Any, Protocol

import anyio
import msgspec
import structlog
import zmq
import zmq.asyncio

from actors.protocol import launch_secret
from actors.protocol.codec import Codec
from actors.protocol.messages import ClientHello, Shutdown, ToEngineCore, ToFrontEnd

log = structlog.get_logger("tandem.transport")


class TransportClosed(Exception):
    """The other side closed the channel (or this side did)."""


class CoreEndpoint(Protocol):
    """The engine core's side: one endpoint, every front end behind it."""

    def send(self, client_index: int, message: ToFrontEnd) -> None: ...

    async def receive(self) -> ToEngineCore: ...

    def close(self) -> None: ...


class ClientEndpoint(Protocol):
    """A front end's side."""

    def send(self, message: ToEngineCore) -> None: ...

    async def receive(self) -> ToFrontEnd: ...

    def close(self) -> None: ...


# ---- in-process ------------------------------------------------------------------------


class InProcessChannel:
    """A core endpoint and `num_clients` client endpoints on one event loop."""

    def __init__(self, num_clients: int = 1, *, roundtrip: bool = False) -> None:
        codec = Codec() if roundtrip else None
        self.core = _InProcessCore(codec)
        self.clients = [_InProcessClient(self.core, index, codec) for index in range(num_clients)]
        self.core.clients = self.clients


class _Inbox:
    def __init__(self) -> None:
        self.send_stream, self.receive_stream = anyio.create_memory_object_stream[Any](math.inf)

    def put(self, message: Any) -> None:
        try:
            self.send_stream.send_nowait(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise TransportClosed("the receiving side is closed") from None

    async def get(self) -> Any:
        try:
            return await self.receive_stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise TransportClosed("the channel is closed") from None

    def close(self) -> None:
        self.send_stream.close()


class _InProcessCore:
    def __init__(self, codec: Codec | None) -> None:
        self._codec = codec
        self.inbox = _Inbox()
        self.clients: list[_InProcessClient] = []

    def send(self, client_index: int, message: ToFrontEnd) -> None:
        if self._codec is not None:
            message = self._codec.decode_to_front_end(self._codec.encode(message))
        try:
            self.clients[client_index].inbox.put(message)
        except TransportClosed:
            log.debug("message_for_closed_client", client_index=client_index)

    async def receive(self) -> ToEngineCore:
        message: ToEngineCore = await self.inbox.get()
        return message

    def close(self) -> None:
        self.inbox.close()
        for client in self.clients:
            client.inbox.close()


class _InProcessClient:
    def __init__(self, core: _InProcessCore, index: int, codec: Codec | None) -> None:
        self._core = core
        self.index = index
        self._codec = codec
        self.inbox = _Inbox()

    def send(self, message: ToEngineCore) -> None:
        if self._codec is not None:
            message = self._codec.decode_to_core(self._codec.encode(message))
        self._core.inbox.put(message)

    async def receive(self) -> ToFrontEnd:
        message: ToFrontEnd = await self.inbox.get()
        return message

    def close(self) -> None:
        self.inbox.close()


# ---- ZMQ ---------------------------------------------------------------------------------


def ipc_address(directory: str, core: int = 0) -> str:
    """The socket of engine core `core` (of --data-parallel-size N) in `directory`."""
    name = "engine.sock" if core == 0 else f"engine-{core}.sock"
    return f"ipc://{os.path.join(directory, name)}"


def peer_identity(client_index: int | None) -> bytes:
    """A DEALER's identity: fresh per process, so that a restarted front end is a new peer
    to the ROUTER, and unguessable, so that no other process can take it over once its
    owner has disconnected and inherit its authentication."""
    name = "control" if client_index is None else f"fe{client_index}"
    return f"{name}-{secrets.token_hex(16)}".encode()


def _socket(kind: int) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(kind)
    # Unbounded queues: a ROUTER drops what exceeds its high-water mark, and a step's
    # outputs must never be dropped. Admission bounds the work in the system instead.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class ZmqCoreEndpoint:
    """The core's ROUTER. Any process of the user can open the socket, so `receive` passes
    on only what decodes and comes from an authenticated peer (one whose ClientHello
    carried the launch `secret`), and drops the rest, whatever its bytes or number of
    frames (logged at a bounded rate). A client index is bound only to an authenticated
    peer; a later authenticated hello for the same index (the supervisor's restart of a
    dead API server) takes it over."""

    def __init__(self, address: str, secret: bytes) -> None:
        self._codec = Codec()
        self._secret = secret
        self._sock = _socket(zmq.ROUTER)
        # The default, said out loud: a peer connecting under a live peer's identity is
        # refused, so it can neither take that peer's replies nor speak as it.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self._sock.bind(address)
        self._identities: dict[int, bytes] = {}
        self._authenticated: set[bytes] = set()
        self._drops = _DropLog()

    @property
    def client_indices(self) -> tuple[int, ...]:
        """The front ends bound to a peer."""
        return tuple(self._identities)

    def send(self, client_index: int, message: ToFrontEnd) -> None:
        identity = self._identities.get(client_index)
        if identity is None:
            log.warning(
                "message_for_unknown_client",
                client_index=client_index,
                message=type(message).__name__,
            )
            return
        try:
            self._sock.send_multipart(
                (identity, self._codec.encode(message)), flags=zmq.NOBLOCK, copy=False
            )
        except zmq.ZMQError as exc:  # closed socket at shutdown, a peer gone
            log.debug("send_failed", client_index=client_index, error=str(exc))

    async def receive(self) -> ToEngineCore:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                raise TransportClosed(str(exc)) from None
            message = self._accept(frames)
            if message is not None:
                return message

    def _accept(self, frames: list[zmq.Frame]) -> ToEngineCore | None:
        """The message of a well-formed frame pair from an authenticated peer (or its hello),
        else None."""
        if len(frames) != 2:  # a DEALER's one frame behind its identity, nothing else
            self._drops.drop("not_one_frame", num_frames=len(frames) - 1)
            return None
        identity, payload = frames[0].bytes, frames[1]
        is_known = identity in self._authenticated
        if not is_known and len(payload) > _MAX_HELLO_BYTES:  # not a hello: never decoded
            self._drops.drop("unknown_peer")
            return None
        try:
            message: ToEngineCore = self._codec.decode_to_core(payload.buffer)
        except Exception:  # noqa: BLE001 - any byte sequence reaches the decoder
            self._drops.drop("undecodable", is_known_peer=is_known)
            return None
        if isinstance(message, ClientHello):
            return self._hello(identity, message)
        if not is_known:
            self._drops.drop("unknown_peer")
            return None
        return message

    def _hello(self, identity: bytes, hello: ClientHello) -> ClientHello | None:
        if not launch_secret.matches(hello.secret, self._secret):
            self._drops.drop("wrong_secret")
            return None
        self._authenticated.add(identity)
        if hello.client_index is None:  # a peer that only sends Shutdown
            return None
        previous = self._identities.get(hello.client_index)
        if previous is not None and previous != identity:  # a restarted front end
            self._authenticated.discard(previous)
        self._identities[hello.client_index] = identity
        return msgspec.structs.replace(hello, secret=b"")  # the core has no use for it

    def close(self) -> None:
        self._sock.close(linger=0)


_MAX_HELLO_BYTES = 1024
"""Larger frames from a peer that has not authenticated are dropped without decoding."""
_DROP_LOG_INTERVAL_S = 10.0


class _DropLog:
    """Logs dropped frames once per interval at most (a flood costs one line per interval),
    with how many were dropped since the last line."""

    def __init__(self) -> None:
        self._num_dropped = 0
        self._logged_at = -math.inf

    def drop(self, reason: str, **fields: Any) -> None:
        """Count (and now and then log) a dropped frame; the caller passes nothing on."""
        self._num_dropped += 1
        now = time.monotonic()
        if now - self._logged_at >= _DROP_LOG_INTERVAL_S:
            log.warning(
                "engine_socket_frame_dropped",
                reason=reason,
                num_dropped=self._num_dropped,
                **fields,
            )
            self._logged_at, self._num_dropped = now, 0


class ZmqClientEndpoint:
    def __init__(self, address: str, client_index: int, secret: bytes) -> None:
        self._codec = Codec()
        self._secret = secret
        self._sock = _socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, peer_identity(client_index))
        self._sock.connect(address)

    def send(self, message: ToEngineCore) -> None:
        if isinstance(message, ClientHello):
            message = msgspec.structs.replace(message, secret=self._secret)
        try:
            self._sock.send(self._codec.encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            raise TransportClosed(str(exc)) from None

    async def receive(self) -> ToFrontEnd:
        try:
            frame = await self._sock.recv(copy=False)
        except zmq.ZMQError as exc:
            raise TransportClosed(str(exc)) from None
        message: ToFrontEnd = self._codec.decode_to_front_end(frame.buffer)
        return message

    def close(self) -> None:
        self._sock.close(linger=0)


def send_shutdown(address: str, secret: bytes, linger_s: float = 2.0) -> None:
    """Tell a core process to shut down, from outside any event loop (the supervisor, which
    is no front end: its hello carries no client index)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
    sock.setsockopt(zmq.IDENTITY, peer_identity(None))
    sock.connect(address)
    codec = Codec()
    sock.send(codec.encode(ClientHello(None, secret)))
    sock.send(codec.encode(Shutdown()))
    sock.close()  # the context sends what is queued for up to `linger_s`
