"""Rank 0 hands each step's scheduler output to every other rank as one buffer.

The sender serialises a step once (the caller's encoding) and broadcasts the bytes over
the group's gloo group: a fixed-size frame carries a 16-byte header (message kind,
payload length) and the first `frame_bytes - 16` payload bytes, so a typical step is one
collective; a larger payload follows in a second broadcast of exactly its remainder.
Receivers block in `recv` until rank 0 sends; a shutdown message ends their loop.
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
        self._frame_u8 = torch.zeros(frame_bytes, dtype=torch.uint8)
        self._frame_np = self._frame_u8.numpy()
        self._header_np = self._frame_np[:_HEADER_BYTES].view(np.uint64)

    def send(self, payload: bytes | bytearray | memoryview) -> None:
        """Broadcast one step's serialised scheduler output (rank 0 only)."""
        self._send(_STEP, memoryview(payload).cast("B"))

    def send_shutdown(self) -> None:
        """Tell every other rank to leave its step loop (rank 0 only)."""
        self._send(_SHUTDOWN, memoryview(b""))

    def recv(self) -> bytes | None:
        """The next step's payload, or None when rank 0 has shut the loop down."""
        self._check_role(is_sender=False)
        self._broadcast(self._frame_u8)
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
        self._broadcast(rest)
        return head + rest.numpy().tobytes()

    def send_object(self, obj: Any) -> None:
        """`send` of `obj` pickled once (for messages without a dedicated encoding)."""
        self.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv_object(self) -> Any | None:
        payload = self.recv()
        return None if payload is None else pickle.loads(payload)

    def _send(self, kind: int, payload: memoryview) -> None:
        self._check_role(is_sender=True)
        num_bytes = payload.nbytes
        inline = min(num_bytes, self._frame_np.size - _HEADER_BYTES)
        self._header_np[:] = (kind, num_bytes)
        self._frame_np[_HEADER_BYTES : _HEADER_BYTES + inline] = np.frombuffer(
            payload[:inline], dtype=np.uint8
        )
        self._broadcast(self._frame_u8)
        if inline < num_bytes:
            rest = np.frombuffer(payload[inline:], dtype=np.uint8).copy()
            self._broadcast(torch.from_numpy(rest))

    def _broadcast(self, buffer_u8: torch.Tensor) -> None:
        dist.broadcast(buffer_u8, src=0, group=self.group.cpu_group)

    def _check_role(self, is_sender: bool) -> None:
        if (self.group.rank == 0) != is_sender:
            role = "only rank 0 sends" if is_sender else "rank 0 does not receive"
            raise RuntimeError(f"step broadcast: {role} (this is rank {self.group.rank})")
