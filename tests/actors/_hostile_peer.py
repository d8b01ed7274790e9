"""A local process that writes to the engine core's ipc socket without the launch secret."""

from __future__ import annotations

import socket
from pathlib import Path

import zmq

from actors.protocol.codec import Codec
from actors.protocol.launch_secret import new_secret
from actors.protocol.messages import AbortRequests, ClientHello, Shutdown

_LINGER_MS = 2000


def _hostile_messages() -> list[list[bytes]]:
    """Frames that do not decode, shapes the protocol never sends, forged hellos and the
    messages of a peer that never authenticated (each list: one DEALER message)."""
    codec = Codec()
    return [
        [b"\xc1 not msgpack"],
        [b"\x92\xa5hello\xc7\x05\x01 bad ndarray ext"],
        [b""],
        [codec.encode(ClientHello(0)), b"x", b"y"],  # three frames behind the identity
        [b"\x00" * (1 << 20)],  # large: dropped without decoding
        [codec.encode(ClientHello(0))],  # no secret
        [codec.encode(ClientHello(1, new_secret()))],  # a wrong one
        [codec.encode(ClientHello(None, b""))],
        [codec.encode(AbortRequests(("r1",)))],
        [codec.encode(Shutdown())],
    ]


def send_hostile_frames(socket_path: Path) -> None:
    """Write bytes that are not even ZMTP to the socket, then every `_hostile_messages()`
    message; returns once they are queued (the ZMQ context sends them in the background)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(socket_path))
        raw.sendall(bytes(range(256)) * 64)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, _LINGER_MS)
    sock.connect(f"ipc://{socket_path}")
    for frames in _hostile_messages():
        sock.send_multipart(frames)
    sock.close()
