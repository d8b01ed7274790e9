"""The disk tier's files (gpu/kv_disk_store.py): a round trip, and every failure a miss:
a corrupt or short file, a full disk (ENOSPC) on write; stale files go at start."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpu.kv_disk_store import DiskStore

BLOCK = bytes(range(256)) * 4


def _only_file(directory: Path) -> Path:
    (path,) = [p for p in directory.iterdir() if p.suffix == ".kvb"]
    return path


def test_a_written_block_reads_back_before_and_after_its_file_exists(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.write(b"h" * 16, BLOCK)
    assert store.read(b"h" * 16) == BLOCK  # queued or written: either way the same bytes
    store.flush()
    assert store.read(b"h" * 16) == BLOCK
    assert _only_file(tmp_path).stat().st_size > len(BLOCK)  # a header with the checksum
    assert store.read(b"x" * 16) is None
    store.close()


def test_an_async_read_gives_the_bytes_later(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.write(b"h" * 16, BLOCK)
    store.flush()
    assert store.read_async(b"h" * 16).result(timeout=30) == BLOCK
    assert store.read_async(b"x" * 16).result(timeout=30) is None
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_corrupt_file_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    store = DiskStore(tmp_path)
    store.write(b"h" * 16, BLOCK)
    store.flush()
    path = _only_file(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-1] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-10]
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    assert store.read(b"h" * 16) is None
    assert not path.exists()
    store.close()


def test_a_full_disk_is_a_miss_and_a_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path)

    def no_space(*_: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("gpu.kv_disk_store.os.replace", no_space)
    store.write(b"h" * 16, BLOCK)
    store.flush()
    assert store.num_write_errors == 1
    assert store.read(b"h" * 16) is None
    assert not list(tmp_path.iterdir())  # the partial file is gone too
    monkeypatch.undo()
    store.write(b"g" * 16, BLOCK)  # the store still works once there is room
    store.flush()
    assert store.read(b"g" * 16) == BLOCK
    store.close()


def test_delete_and_clear_remove_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.write(b"a" * 16, BLOCK)
    store.write(b"b" * 16, BLOCK)
    store.delete(b"a" * 16)
    store.flush()
    assert store.read(b"a" * 16) is None and store.read(b"b" * 16) == BLOCK
    store.clear()
    store.flush()
    assert store.read(b"b" * 16) is None and not list(tmp_path.iterdir())
    store.close()


def test_files_of_an_earlier_run_are_deleted_at_start(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.write(b"h" * 16, BLOCK)
    store.flush()
    store.close()
    (tmp_path / "notes.txt").write_text("not ours")
    again = DiskStore(tmp_path)
    assert again.read(b"h" * 16) is None
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    again.close()
