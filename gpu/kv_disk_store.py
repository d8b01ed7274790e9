"""The disk tier's files: one file per KV block hash, written by a background thread so a
step never waits for the disk, each checked by a checksum when read back, by another
background thread for the engine core (`read_async`), which never waits for a read.

Every failure is a miss, never an error: a write that fails (a full disk, ENOSPC, or any
OSError) leaves no file and a log line; a read of a missing, short or corrupt file returns
None, logs and deletes the file. The directory is the engine's own: files left by an earlier
run (perhaps of another model, whose hashes could collide with this one's) are deleted at
start. The engine core keeps the index and its bound (actors/core/kv_offload.py); this
module only stores bytes.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import structlog

log = structlog.get_logger("tandem.kv_disk")

_MAGIC = b"TKVB0001"
_DIGEST_SIZE = 32
_HEADER_SIZE = len(_MAGIC) + 8 + _DIGEST_SIZE
_SUFFIX = ".kvb"
_STOP = ("stop",)


class DiskStore:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_all()
        self._pending: dict[bytes, bytes] = {}
        """Blocks queued for writing: a read finds them here before their file exists."""
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.num_write_errors = 0
        self._thread = threading.Thread(target=self._run, name="tandem-kv-disk", daemon=True)
        self._thread.start()
        # Reads have a thread of their own: a read never waits behind queued writes.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tandem-kv-disk-read")

    # ---- the engine's calls (any thread) --------------------------------------------

    def write(self, block_hash: bytes, data: bytes) -> None:
        """Queue a block's file; returns at once."""
        with self._lock:
            self._pending[block_hash] = data
        self._jobs.put(("write", block_hash, data))

    def read(self, block_hash: bytes) -> bytes | None:
        """The block's bytes, or None when missing, short or corrupt."""
        with self._lock:
            data = self._pending.get(block_hash)
        if data is not None:
            return data
        path = self._path(block_hash)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kv_disk_read_failed", file=path.name, error=str(exc))
            return None
        data = _checked(raw)
        if data is None:
            log.warning("kv_disk_block_corrupt", file=path.name, num_bytes=len(raw))
            _unlink(path)
        return data

    def read_async(self, block_hash: bytes) -> Future[bytes | None]:
        """`read` on the reader thread; the future's result is never an exception."""
        return self._reader.submit(self.read, block_hash)

    def delete(self, block_hash: bytes) -> None:
        self._jobs.put(("delete", block_hash))

    def clear(self) -> None:
        """Delete every block (after the writes already queued)."""
        with self._lock:
            self._pending.clear()
        self._jobs.put(("clear",))

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the jobs queued so far are done (tests)."""
        done = threading.Event()
        self._jobs.put(("flush", done))
        done.wait(timeout_s)

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._reader.shutdown(wait=False, cancel_futures=True)

    # ---- the writer thread ----------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) != _STOP:
            kind = job[0]
            if kind == "write":
                self._write(job[1], job[2])
            elif kind == "delete":
                _unlink(self._path(job[1]))
            elif kind == "clear":
                self._remove_all()
            elif kind == "flush":
                job[1].set()

    def _write(self, block_hash: bytes, data: bytes) -> None:
        path = self._path(block_hash)
        temporary = path.with_suffix(".tmp")
        digest = hashlib.blake2b(data, digest_size=_DIGEST_SIZE).digest()
        try:
            with open(temporary, "wb") as file:
                file.write(_MAGIC + len(data).to_bytes(8, "little") + digest)
                file.write(data)
            os.replace(temporary, path)
        except OSError as exc:  # a full disk (ENOSPC) or any other: the block is a miss
            self.num_write_errors += 1
            log.warning("kv_disk_write_failed", file=path.name, error=str(exc))
            _unlink(temporary)
        finally:
            with self._lock:
                if self._pending.get(block_hash) is data:
                    del self._pending[block_hash]

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + _SUFFIX)

    def _remove_all(self) -> None:
        for path in self.directory.iterdir():
            if path.suffix in (_SUFFIX, ".tmp"):
                _unlink(path)


def _checked(raw: bytes) -> bytes | None:
    if len(raw) < _HEADER_SIZE or not raw.startswith(_MAGIC):
        return None
    num_bytes = int.from_bytes(raw[len(_MAGIC) : len(_MAGIC) + 8], "little")
    digest = raw[len(_MAGIC) + 8 : _HEADER_SIZE]
    data = raw[_HEADER_SIZE:]
    if len(data) != num_bytes:
        return None
    if hashlib.blake2b(data, digest_size=_DIGEST_SIZE).digest() != digest:
        return None
    return data


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("kv_disk_delete_failed", file=path.name, error=str(exc))
