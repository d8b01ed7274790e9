"""Bytes for the protocol messages (actors/protocol/messages.py): msgpack through msgspec, numpy
arrays as one extension blob each (dtype, shape, raw buffer), never element by element."""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

import msgspec
import numpy as np

from actors.protocol.messages import ToEngineCore, ToFrontEnd

_NDARRAY_EXT = 1
_HEADER = struct.Struct("<B")  # length of the dtype string


def enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        dtype = array.dtype.str.encode("ascii")
        shape = struct.pack(f"<B{array.ndim}q", array.ndim, *array.shape)
        return msgspec.msgpack.Ext(
            _NDARRAY_EXT, _HEADER.pack(len(dtype)) + dtype + shape + array.tobytes()
        )
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    (dtype_len,) = _HEADER.unpack_from(data, 0)
    offset = _HEADER.size
    dtype = np.dtype(bytes(data[offset : offset + dtype_len]).decode("ascii"))
    offset += dtype_len
    (ndim,) = struct.unpack_from("<B", data, offset)
    shape = struct.unpack_from(f"<{ndim}q", data, offset + 1)
    offset += 1 + 8 * ndim
    # A copy: the receive buffer is reused by the transport.
    return np.frombuffer(data[offset:], dtype=dtype).reshape(shape).copy()


def dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {type_}")


class Codec:
    """Encoder for either direction and a typed decoder per direction."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
        self._to_core = msgspec.msgpack.Decoder(ToEngineCore, ext_hook=ext_hook, dec_hook=dec_hook)
        self._to_front_end = msgspec.msgpack.Decoder(
            ToFrontEnd, ext_hook=ext_hook, dec_hook=dec_hook
        )

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def decode_to_core(self, data: bytes | memoryview) -> Any:
        return self._to_core.decode(data)

    def decode_to_front_end(self, data: bytes | memoryview) -> Any:
        return self._to_front_end.decode(data)


FRAME_HEADER = struct.Struct("<I")
"""Over a pipe (a front end and its grammar checker processes), a message is a frame: this
4-byte little-endian length, then the msgpack bytes."""


def frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's payload; None at the end of the stream."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    payload = stream.read(size)
    return payload if len(payload) == size else None
