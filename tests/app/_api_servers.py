"""Driving `tandem serve --api-server-count N` from a test: which process is which, a
connection held to a chosen one, a stream read in a thread, an API server killed and its
successor awaited, and the aborted-request count read from /metrics."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.app._serve_process import ServeProcess


def api_server_pids(server: ServeProcess) -> dict[int, int]:
    return {
        int(line["process"].rsplit("_", 1)[1]): int(line["pid"])
        for line in server.lines()
        if str(line.get("process", "")).startswith("api_server_")
    }


def kill_api_server_and_wait_for_its_successor(server: ServeProcess, index: int) -> None:
    victim = api_server_pids(server)[index]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = api_server_pids(server)
        restarted = pids.get(index) not in (None, victim) and any(
            line.get("event") == "engine_ready" and line.get("pid") == pids[index]
            for line in server.lines()
        )
        if restarted:
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed API server {index} was not restarted")


def abort_count(metrics_text: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if (
                sample.name == "vllm:request_success_total"
                and sample.labels.get("finished_reason") == "abort"
            ):
                return float(sample.value)
    raise AssertionError("vllm:request_success_total{finished_reason='abort'} not exported")


def answering_api_servers(url: str, max_connections: int = 40) -> set[int]:
    """The API servers that accept new connections, found with up to `max_connections`
    kept open at once: each API server takes its share by counts of open connections
    (app/connection_balance.py), so one holding connections of earlier tests leaves new
    ones to the others until the counts even out."""
    clients: list[httpx.Client] = []
    answered: set[int] = set()
    try:
        for _ in range(max_connections):
            clients.append(httpx.Client(base_url=url, timeout=10))
            answered.add(clients[-1].get("/version").json()["api_server"])
            if len(answered) > 1 and len(clients) >= 4:
                break
    finally:
        for client in clients:
            client.close()
    return answered


def clients_of_api_server(url: str, index: int, count: int) -> list[httpx.Client]:
    """`count` clients, each holding a keep-alive connection that API server `index`
    accepted (the kernel hands each new connection to either process)."""
    kept: list[httpx.Client] = []
    for _ in range(200):
        client = httpx.Client(base_url=url, timeout=60)
        if client.get("/version").json()["api_server"] == index:
            kept.append(client)
            if len(kept) == count:
                return kept
        else:
            client.close()
    raise AssertionError(f"API server {index} accepted too few connections")


class StreamInThread:
    """The chat `body`, streamed on `client`'s connection and read in a thread; `cut` once
    the connection broke before the stream's end."""

    def __init__(self, client: httpx.Client, body: dict[str, Any]) -> None:
        self.first_chunk = threading.Event()
        self.cut = False
        self.thread = threading.Thread(target=self._read, args=(client, body), daemon=True)
        self.thread.start()

    def _read(self, client: httpx.Client, body: dict[str, Any]) -> None:
        try:
            with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.first_chunk.set()
        except httpx.TransportError:
            self.cut = True
        finally:
            client.close()
