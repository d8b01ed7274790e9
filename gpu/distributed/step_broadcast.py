"""Rank 0 hands each step's scheduler output to every other rank as one buffer.

The sender serialises a step once (the caller's encoding) and sends the bytes to every
other rank over the group's gloo group: a fixed-size frame carries a 16-byte header
(message kind, payload length) and the first `frame_bytes - 16` payload bytes, so a
typical step is one message per rank; a larger payload follows in a second message of
exactly its remainder. Rank 0 does not wait for the others to take a step (a rank busy
with the previous one, as a pipeline stage is, would hold it up): its sends complete in
the background, each from a buffer of its own. Receivers block in `recv` until rank 0
sends; a shutdown message ends their loop.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gpu.distributed.group import TPGroup

DEFAULT_FRAME_BYTES = 64 * 1024
_HEADER_BYTES = 16
_STEP, _SHUTDOWN = 1, 2


class StepBroadcaster:
    """One per rank; rank 0 calls `send`/`send_shutdown`, the others `recv`."""

    def __init__(self, group: TPGroup, frame_bytes: int = DEFAULT_FRAME_BYTES) -> None:
        if frame_bytes <= _HEADER_BYTES:
            raise ValueError(f"frame_bytes must exceed {_HEADER_BYTES}, got {frame_bytes}")
        self.group = group
        self._frame_bytes = frame_bytes
        self._frame_u8 = torch.zeros(frame_bytes, dtype=torch.uint8)
        self._frame_np = self._frame_u8.numpy()
        self._header_np = self._frame_np[:_HEADER_BYTES].view(np.uint64)
        self._sends: list[tuple[Any, torch.Tensor]] = []
        """Rank 0's sends not yet known to be complete, with their buffers."""

    def send(self, payload: bytes | bytearray | memoryview) -> None:
        """Broadcast one step's serialised scheduler output (rank 0 only)."""
        self._send(_STEP, memoryview(payload).cast("B"))

    def send_shutdown(self) -> None:
        """Tell every other rank to leave its step loop (rank 0 only); returns once every
        rank has taken every message (rank 0 may leave the group next)."""
        self._send(_SHUTDOWN, memoryview(b""))
        self.wait_sent()

    def recv(self) -> bytes | None:
        """The next step's payload, or None when rank 0 has shut the loop down."""
        self._check_role(is_sender=False)
        self._recv(self._frame_u8)
        kind, num_bytes = (int(v) for v in self._header_np)
        if kind == _SHUTDOWN:
            return None
        if kind != _STEP:
            raise RuntimeError(f"corrupt step broadcast header (kind {kind})")
        inline = min(num_bytes, self._frame_np.size - _HEADER_BYTES)
        head = self._frame_np[_HEADER_BYTES : _HEADER_BYTES + inline].tobytes()
        if inline == num_bytes:
            return head
        rest = torch.empty(num_bytes - inline, dtype=torch.uint8)
        self._recv(rest)
        return head + rest.numpy().tobytes()

    def send_object(self, obj: Any) -> None:
        """`send` of `obj` pickled once (for messages without a dedicated encoding)."""
        self.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv_object(self) -> Any | None:
        payload = self.recv()
        return None if payload is None else pickle.loads(payload)

    def wait_sent(self) -> None:
        """Block until every message rank 0 has sent has been taken (rank 0 only)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _send(self, kind: int, payload: memoryview) -> None:
        self._check_role(is_sender=True)
        num_bytes = payload.nbytes
        inline = min(num_bytes, self._frame_bytes - _HEADER_BYTES)
        frame = np.zeros(self._frame_bytes, dtype=np.uint8)
        frame[:_HEADER_BYTES].view(np.uint64)[:] = (kind, num_bytes)
        frame[_HEADER_BYTES : _HEADER_BYTES + inline] = np.frombuffer(
            payload[:inline], dtype=np.uint8
        )
        self._sends = [(work, buf) for work, buf in self._sends if not work.is_completed()]
        self._send_to_all(torch.from_numpy(frame))
        if inline < num_bytes:
            rest = np.frombuffer(payload[inline:], dtype=np.uint8).copy()
            self._send_to_all(torch.from_numpy(rest))

    def _send_to_all(self, buffer_u8: torch.Tensor) -> None:
        group = self.group.cpu_group
        for rank in range(1, self.group.world_size):
            # The buffer stays referenced until its send is known to be complete.
            self._sends.append((dist.isend(buffer_u8, dst=rank, group=group), buffer_u8))

    def _recv(self, buffer_u8: torch.Tensor) -> None:
        dist.recv(buffer_u8, src=0, group=self.group.cpu_group)

    def _check_role(self, is_sender: bool) -> None:
        if (self.group.rank == 0) != is_sender:
            role = "only rank 0 sends" if is_sender else "rank 0 does not receive"
            raise RuntimeError(f"step broadcast: {role} (this is rank {self.group.rank})")
