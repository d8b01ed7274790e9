from __future__ import annotations

import time

import numpy as np
import pytest

from gpu.weights.dequant import GGMLType
from gpu.weights.gguf_file import GGUFFile, GGUFFormatError
from tests._embedded_model import embedded_gguf_path


def _write_all_value_types(path: str) -> dict[str, object]:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    expected: dict[str, object] = {"general.architecture": "llama"}
    values = [
        ("t.u8", 200, gguf.GGUFValueType.UINT8),
        ("t.i8", -100, gguf.GGUFValueType.INT8),
        ("t.u16", 60000, gguf.GGUFValueType.UINT16),
        ("t.i16", -30000, gguf.GGUFValueType.INT16),
        ("t.u32", 4_000_000_000, gguf.GGUFValueType.UINT32),
        ("t.i32", -2_000_000_000, gguf.GGUFValueType.INT32),
        ("t.u64", 2**63 + 5, gguf.GGUFValueType.UINT64),
        ("t.i64", -(2**62), gguf.GGUFValueType.INT64),
        ("t.f32", 0.25, gguf.GGUFValueType.FLOAT32),
        ("t.f64", 1e-300, gguf.GGUFValueType.FLOAT64),
        ("t.bool", True, gguf.GGUFValueType.BOOL),
        ("t.str", "héllo ✓ 😀", gguf.GGUFValueType.STRING),
    ]
    for key, value, value_type in values:
        writer.add_key_value(key, value, value_type)
        expected[key] = value
    strings = ["", "a b", "Ġthe", "日本", "<|im_start|>"] * 1000
    writer.add_array("t.strings", strings)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.nested", [[1, 2], [3]])
    expected.update({"t.strings": strings})
    writer.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b", np.ones((2, 3, 5), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_reads_every_value_type_and_tensor(tmp_path):
    path = str(tmp_path / "types.gguf")
    expected = _write_all_value_types(path)
    f = GGUFFile(path)
    assert f.version == 3
    for key, value in expected.items():
        assert f.metadata[key] == value, key
    assert f.metadata["t.ints"].tolist() == [1, -2, 3]
    assert f.metadata["t.floats"].tolist() == [0.5, 1.5]
    assert [list(a) for a in f.metadata["t.nested"]] == [[1, 2], [3]]
    assert f.tensors["a"].shape == (3, 4) and f.tensors["a"].ggml_type == GGMLType.F32
    assert f.tensors["b"].shape == (2, 3, 5) and f.tensors["b"].ggml_type == GGMLType.F16
    a = f.tensor_bytes("a").view(np.float32).reshape(3, 4)
    np.testing.assert_array_equal(a, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert f.tensors["a"].offset % f.alignment == 0 and f.tensors["b"].offset % f.alignment == 0


def test_tensor_bytes_are_a_view_of_the_file_map(tmp_path):
    path = str(tmp_path / "types.gguf")
    _write_all_value_types(path)
    f = GGUFFile(path)
    raw = f.tensor_bytes("b")
    assert isinstance(raw.base, np.memmap) or isinstance(raw, np.memmap)
    assert np.shares_memory(raw, f._data_u8_np)
    assert raw.nbytes == 2 * 3 * 5 * 2


@pytest.mark.slow
def test_embedded_file_matches_gguf_reader():
    from gguf import GGUFReader

    path = embedded_gguf_path()
    start = time.perf_counter()
    ours = GGUFFile(path)
    parse_s = time.perf_counter() - start
    print(f"\nGGUFFile parse of the embedded model: {parse_s * 1000:.0f} ms")
    reader = GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    assert ours.version == reader.fields["GGUF.version"].contents()
    for key, field in fields.items():
        theirs = field.contents()
        mine = ours.metadata[key]
        if isinstance(mine, np.ndarray):
            mine = mine.tolist()
        if isinstance(theirs, float):
            assert np.float32(mine) == np.float32(theirs), key
        else:
            assert mine == theirs, key
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(ours.metadata["tokenizer.ggml.merges"]) == 48900
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.ggml_type == int(tensor.tensor_type)
        assert info.shape == tuple(reversed([int(n) for n in tensor.shape]))
        assert info.offset == tensor.data_offset
        assert info.num_bytes == tensor.n_bytes
    assert parse_s < 2.0  # generous: the point is to beat GGUFReader's seconds by far


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty.gguf"):
        GGUFFile(path)


def test_unsupported_version(tmp_path):
    path = tmp_path / "v9.gguf"
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFFormatError, match="version 9"):
        GGUFFile(path)


def test_truncated_metadata(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(open(embedded_gguf_path(), "rb").read(1024))
    with pytest.raises(GGUFFormatError, match="truncated"):
        GGUFFile(path)


def test_truncated_tensor_data(tmp_path):
    full = tmp_path / "full.gguf"
    _write_all_value_types(str(full))
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-8])
    with pytest.raises(GGUFFormatError, match="tensor 'b'"):
        GGUFFile(cut)
