"""A real `tandem serve` (Hypercorn on 127.0.0.1, a free port) in a background thread.

The embedded model is loaded once per test session and shared: each test module starts its
own server on it (a second instead of a full load), with the settings it needs. Servers
never overlap in time, since they share the model's KV memory.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import anyio
import httpx

from app.config import EngineConfig
from app.server import TandemServer
from app.server_state import EngineSnapshot, ServerState, ServeSettings

MAX_MODEL_LEN = 2048
ENGINE = EngineConfig(model="default", device="cpu", max_model_len=MAX_MODEL_LEN,
                      max_num_seqs=64, max_num_batched_tokens=2048)
_START_TIMEOUT_S = 120.0


@functools.cache
def shared_model() -> Any:
    from app.startup import load_engine

    return load_engine(ENGINE)


class RunningServer:
    def __init__(self, **settings: Any) -> None:
        engine = settings.pop("engine", ENGINE)
        self.settings = ServeSettings(engine=engine, port=0, **settings)
        self.server = TandemServer(self.settings, ServerState(self.settings, shared_model()))
        self.url = self.server.url
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-test-server", daemon=True)
        self._thread.start()
        self._wait_healthy()

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
                raise RuntimeError(f"the test server exited with code {self.exit_code}")
            time.sleep(0.05)
        raise TimeoutError("the test server did not become healthy")

    @property
    def state(self) -> ServerState:
        return self.server.state

    def snapshot(self) -> EngineSnapshot:
        return self.server.run_coroutine(self.server.state.engine_snapshot).result(timeout=30)

    def wait_engine_idle(self, timeout_s: float = 30.0) -> EngineSnapshot:
        """The first snapshot with nothing running, waiting or admitted."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.snapshot()
            idle = snap.num_running == 0 and snap.num_waiting == 0 \
                and snap.num_unfinished_admitted == 0
            if idle or time.monotonic() > deadline:
                return snap
            time.sleep(0.05)

    def stop(self) -> None:
        """Drain and stop; the server must exit cleanly (code 0)."""
        if self._thread.is_alive():
            self.server.request_shutdown()
            self._thread.join(timeout=60)
        assert not self._thread.is_alive() and self.exit_code == 0, self.exit_code
