"""The server side of a soak: a real `tandem serve` (Hypercorn on 127.0.0.1, a free port)
in a background thread of this process, with handles on its engine for the checks that
HTTP cannot make (engine snapshot, the KV cache manager's invariants), and a sampler of
the process's resident memory.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import anyio
import httpx

from app.server import TandemServer
from app.server_state import EngineSnapshot, ServerState, ServeSettings

_START_TIMEOUT_S = 300.0


class InProcessServer:
    """`preloaded`: an actors.core.engine_startup.LoadedEngine to serve (see ServerState)."""

    def __init__(self, settings: ServeSettings, preloaded: Any = None) -> None:
        self.settings = settings
        self.server = TandemServer(settings, ServerState(settings, preloaded))
        self.url = self.server.url
        self.pid = os.getpid()
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-server", daemon=True)
        self._thread.start()
        self._wait_healthy()

    @property
    def state(self) -> ServerState:
        return self.server.state

    def _run(self) -> None:
        self.exit_code = anyio.run(lambda: self.server.serve(handle_signals=False))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if not self._thread.is_alive():
                raise RuntimeError(f"the server exited with code {self.exit_code}")
            time.sleep(0.05)
        raise TimeoutError("the server did not become healthy")

    def snapshot(self) -> EngineSnapshot:
        return self.server.run_coroutine(self.state.engine_snapshot).result(timeout=30)

    def check_kv_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant of the KV cache manager."""

        self.server.run_coroutine(self.state.check_kv_invariants).result(timeout=30)

    def wait_idle(self, timeout_s: float = 60.0) -> EngineSnapshot:
        """The first snapshot with nothing running, waiting or admitted (or the last one
        taken when `timeout_s` ran out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.snapshot()
            idle = (snap.num_running, snap.num_waiting, snap.num_unfinished_admitted) == (0, 0, 0)
            if idle or time.monotonic() > deadline:
                return snap
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Drain and stop (what SIGTERM does); returns the exit code."""
        if self._thread.is_alive():
            self.server.request_shutdown()
            self._thread.join(timeout=timeout_s)
        return self.exit_code

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def resident_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


@dataclass(frozen=True, slots=True)
class RssSample:
    elapsed_s: float
    rss_bytes: int
    num_done: int
    """Requests finished when the sample was taken."""


class RssSampler:
    """Samples a process's RSS every `interval_s` in a thread, tagging each sample with the
    progress `num_done()` reports."""

    def __init__(self, pid: int, num_done: Callable[[], int], interval_s: float = 0.25) -> None:
        self.pid = pid
        self.samples: list[RssSample] = []
        self._num_done = num_done
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tandem-rss-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take()
            self._stop.wait(self._interval_s)

    def _take(self) -> None:
        self.samples.append(
            RssSample(time.monotonic() - self._started, resident_bytes(self.pid), self._num_done())
        )

    def window_median(self, first_done: int, last_done: int) -> int:
        """Median RSS of the samples taken while [first_done, last_done] requests had
        finished (RSS jitters by tens of MiB from sample to sample as the allocator
        takes and returns memory, so a window says more than one sample)."""
        window = sorted(s.rss_bytes for s in self.samples if first_done <= s.num_done <= last_done)
        if not window:
            return self.at_progress(first_done)
        return window[len(window) // 2]

    def at_progress(self, num_done: int) -> int:
        """RSS of the first sample taken once `num_done` requests had finished."""
        for sample in self.samples:
            if sample.num_done >= num_done:
                return sample.rss_bytes
        return self.samples[-1].rss_bytes
