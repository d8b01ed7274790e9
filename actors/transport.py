"""How protocol messages travel between the front ends and the engine core.

- ZMQ over an ipc socket when the core is its own process: the core binds a ROUTER, each
  front end connects a DEALER, so one socket pair carries both directions and the core
  answers each front end on its own identity.
- In-process (tests, the offline `LLM`): both sides on one event loop, message objects
  passed as they are, or through the codec (`roundtrip=True`) to prove they serialize.

Either way the same typed messages (actors/messages.py) cross, one per request or per step.
"""

from __future__ import annotations

import math
import os
import secrets
from typing import Any, Protocol

import anyio
import structlog
import zmq
import zmq.asyncio

from actors.codec import Codec
from actors.messages import ClientHello, ToEngineCore, ToFrontEnd

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

def ipc_address(directory: str) -> str:
    return f"ipc://{os.path.join(directory, 'engine.sock')}"


def _socket(kind: int) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(kind)
    # Unbounded queues: a ROUTER drops what exceeds its high-water mark, and a step's
    # outputs must never be dropped. Admission bounds the work in the system instead.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class ZmqCoreEndpoint:
    def __init__(self, address: str) -> None:
        self._codec = Codec()
        self._sock = _socket(zmq.ROUTER)
        self._sock.bind(address)
        self._identities: dict[int, bytes] = {}

    def send(self, client_index: int, message: ToFrontEnd) -> None:
        identity = self._identities.get(client_index)
        if identity is None:
            log.warning("message_for_unknown_client", client_index=client_index,
                        message=type(message).__name__)
            return
        try:
            self._sock.send_multipart((identity, self._codec.encode(message)), flags=zmq.NOBLOCK,
                                      copy=False)
        except zmq.ZMQError as exc:  # closed socket at shutdown, a peer gone
            log.debug("send_failed", client_index=client_index, error=str(exc))

    async def receive(self) -> ToEngineCore:
        try:
            identity, payload = await self._sock.recv_multipart(copy=False)
        except zmq.ZMQError as exc:
            raise TransportClosed(str(exc)) from None
        message: ToEngineCore = self._codec.decode_to_core(payload.buffer)
        if isinstance(message, ClientHello):
            self._identities[message.client_index] = identity.bytes
        return message

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqClientEndpoint:
    def __init__(self, address: str, client_index: int) -> None:
        self._codec = Codec()
        self._sock = _socket(zmq.DEALER)
        # A fresh identity per process: a restarted front end is a new peer to the ROUTER.
        self._sock.setsockopt(zmq.IDENTITY, f"fe{client_index}-{secrets.token_hex(4)}".encode())
        self._sock.connect(address)

    def send(self, message: ToEngineCore) -> None:
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
