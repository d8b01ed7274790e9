"""A fast reader for GGUF v2/v3 files (llama.cpp's model format).

The header, metadata and tensor table are parsed in one pass over a memory map; tensor data
stays in the map (`GGUFFile.tensor_bytes` returns a zero-copy uint8 view) until it is
dequantized. Large string arrays (a tokenizer's vocabulary and merges) are decoded in a
tight loop over a memoryview, which is ~50x faster than `gguf.GGUFReader`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.weights.ggml_types import tensor_num_bytes

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf spec, enum gguf_type).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32 = 0, 1, 2, 3, 4, 5, 6
_BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 7, 8, 9, 10, 11, 12

_SCALAR_DTYPES: dict[int, np.dtype] = {
    _UINT8: np.dtype("<u1"),
    _INT8: np.dtype("<i1"),
    _UINT16: np.dtype("<u2"),
    _INT16: np.dtype("<i2"),
    _UINT32: np.dtype("<u4"),
    _INT32: np.dtype("<i4"),
    _FLOAT32: np.dtype("<f4"),
    _BOOL: np.dtype("<u1"),
    _UINT64: np.dtype("<u8"),
    _INT64: np.dtype("<i8"),
    _FLOAT64: np.dtype("<f8"),
}
_SCALAR_STRUCTS = {
    code: struct.Struct("<" + fmt)
    for code, fmt in zip(
        (
            _UINT8,
            _INT8,
            _UINT16,
            _INT16,
            _UINT32,
            _INT32,
            _FLOAT32,
            _BOOL,
            _UINT64,
            _INT64,
            _FLOAT64,
        ),
        "BbHhIifBQqd",
        strict=True,
    )
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF file (bad magic, unknown version, truncated, corrupt)."""


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]
    """numpy order (outermost first): the reverse of ggml's `ne`."""
    ggml_type: int
    """A `GGMLType` value."""
    offset: int
    """Absolute byte offset of the tensor's data in the file."""
    num_bytes: int


class GGUFFile:
    """A parsed GGUF file. Metadata values are Python scalars, `str`, or lists; numeric
    arrays are read-only numpy arrays."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self._data_u8_np = np.memmap(self.path, dtype=np.uint8, mode="c")
        except ValueError as exc:  # numpy refuses to map an empty file
            raise GGUFFormatError(f"{self.path}: not a GGUF file ({exc})") from None
        parser = _Parser(memoryview(self._data_u8_np), self.path)
        self.version, self.metadata, self.tensors, self.data_offset = parser.parse()
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's raw (possibly quantized) data."""
        info = self.tensors[name]
        return self._data_u8_np[info.offset : info.offset + info.num_bytes]


class _Parser:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {what}")

    def need(self, num_bytes: int) -> None:
        if num_bytes < 0 or self.pos + num_bytes > len(self.buf):
            raise self.fail(
                f"truncated or corrupt GGUF file (needs {self.pos + num_bytes} bytes, "
                f"file has {len(self.buf)})"
            )

    def u32(self) -> int:
        self.need(4)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        self.need(8)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        num_bytes = self.u64()
        self.need(num_bytes)
        raw = self.buf[self.pos : self.pos + num_bytes]
        self.pos += num_bytes
        return _decode(raw)

    def parse(self) -> tuple[int, dict[str, Any], dict[str, GGUFTensorInfo], int]:
        if len(self.buf) < 4 or bytes(self.buf[:4]) != GGUF_MAGIC:
            raise self.fail("not a GGUF file (missing 'GGUF' magic bytes)")
        self.pos = 4
        version = self.u32()
        if version not in SUPPORTED_VERSIONS:
            hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
            raise self.fail(f"unsupported GGUF version {version}{hint}; supported: 2, 3")
        num_tensors = self.u64()
        num_kv = self.u64()
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self.string()
            metadata[key] = self.value(self.u32())
        infos = [self.tensor_info() for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise self.fail(f"invalid general.alignment {alignment}")
        data_offset = -(-self.pos // alignment) * alignment
        tensors = self.place_tensors(infos, data_offset)
        return version, metadata, tensors, data_offset

    def value(self, type_code: int) -> Any:
        if type_code == _STRING:
            return self.string()
        if type_code == _ARRAY:
            return self.array()
        packer = _SCALAR_STRUCTS.get(type_code)
        if packer is None:
            raise self.fail(f"unknown metadata value type {type_code}")
        self.need(packer.size)
        (value,) = packer.unpack_from(self.buf, self.pos)
        self.pos += packer.size
        return bool(value) if type_code == _BOOL else value

    def array(self) -> Any:
        elem_type = self.u32()
        count = self.u64()
        if elem_type == _STRING:
            return self.string_array(count)
        dtype = _SCALAR_DTYPES.get(elem_type)
        if dtype is None:
            return [self.value(elem_type) for _ in range(count)]
        self.need(count * dtype.itemsize)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += count * dtype.itemsize
        if elem_type == _BOOL:
            values = values.astype(bool)
        values.flags.writeable = False
        return values

    def string_array(self, count: int) -> list[str]:
        # One tight loop: the 49k-entry vocabularies dominate metadata parsing time.
        buf, pos, size = self.buf, self.pos, len(self.buf)
        unpack_u64 = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8)
            (num_bytes,) = unpack_u64(buf, pos)
            end = pos + 8 + num_bytes
            if end > size:
                self.pos = pos + 8
                self.need(num_bytes)
            append(_decode(buf[pos + 8 : end]))
            pos = end
        self.pos = pos
        return out

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        num_dims = self.u32()
        if num_dims > 8:
            raise self.fail(f"tensor {name!r} has {num_dims} dimensions (corrupt file?)")
        ne = [self.u64() for _ in range(num_dims)]
        ggml_type = self.u32()
        relative_offset = self.u64()
        return name, tuple(reversed(ne)), ggml_type, relative_offset

    def place_tensors(
        self, infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int
    ) -> dict[str, GGUFTensorInfo]:
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, relative_offset in infos:
            num_bytes = tensor_num_bytes(ggml_type, shape)
            offset = data_offset + relative_offset
            if num_bytes is not None and offset + num_bytes > len(self.buf):
                raise self.fail(
                    f"truncated GGUF file: tensor {name!r} needs bytes up to "
                    f"{offset + num_bytes}, file has {len(self.buf)}"
                )
            if name in tensors:
                raise self.fail(f"duplicate tensor name {name!r}")
            tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, num_bytes or 0)
        return tensors


def _decode(raw: memoryview) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        return str(raw, "utf-8", "replace")
