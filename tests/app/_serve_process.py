"""A real `tandem serve` in a subprocess (front end, engine core and, with
--api-server-count, a supervisor): started on a free port, its JSON log parsed, its
process tree inspected."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests._embedded_model import embedded_gguf_path

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0
CPU_FLAGS = (
    "--device",
    "cpu",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--num-kv-blocks",
    "96",
    "--log-format",
    "json",
)


class ServeProcess:
    def __init__(self, log_path: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        if "--model" not in flags:
            embedded_gguf_path()  # skips the test where the embedded model is not installed
        self.log_path = log_path
        with log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "serve", "--port", "0", *CPU_FLAGS, *flags],
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        self.url = self._wait_healthy()

    def _wait_healthy(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            url = url or next(
                (line["url"] for line in self.lines() if line.get("event") == "server_listening"),
                None,
            )
            if url is not None and health(url) == 200:
                return str(url)
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"tandem serve did not start:\n{self.log_path.read_text()[-3000:]}")

    def lines(self) -> list[dict[str, Any]]:
        """Every complete JSON log line so far (fails on any line that is not JSON)."""
        text = self.log_path.read_text()
        complete = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def descendants(self) -> list[int]:
        return descendants(self.proc.pid)

    def engine_pid(self) -> int:
        [pid] = {line["pid"] for line in self.lines() if line.get("process") == "engine_core"}
        return int(pid)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.descendants()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def descendants(pid: int) -> list[int]:
    """Live (non-zombie) descendants of `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] != "Z"
