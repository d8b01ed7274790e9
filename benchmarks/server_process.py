"""The server side of a benchmark run: `tandem serve ARGS` started on a free port and stopped
when the run ends, waiting for a server to answer, asking it which model and version it
serves, and reading its own metrics after the run."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import anyio
import httpx

from benchmarks.serve_config import ServeConfig
from benchmarks.stream_client import auth_headers

SERVER_READY_TIMEOUT_S = 600.0
SERVER_METRICS = ("tandem:gpu_idle_fraction", "vllm:num_preemptions_total")


class ServerUnavailableError(RuntimeError):
    """The server did not answer /v1/models in time, or its warmup requests failed."""


def free_port() -> int:
    """A port free now on the loopback interface (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def answers(url: str) -> bool:
    """Whether a GET of `url` gets a 200 within 5 s (not yet listening counts as no)."""
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def tandem_server(server_args: str | None) -> Iterator[str | None]:
    """`tandem serve ARGS` on a free port until the block ends (None: no server to start)."""
    if server_args is None:
        yield None
        return
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        *shlex.split(server_args),
        "--port",
        str(port),
    ]
    server = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while not answers(base_url + "/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise ServerUnavailableError(
                    f"`{shlex.join(command)}` did not become healthy (exit code {server.poll()})"
                )
            time.sleep(0.5)
        yield base_url
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()


async def model_and_version(config: ServeConfig) -> tuple[str, Any]:
    """The model to send (config.model, else the first /v1/models lists, waiting up to
    config.ready_timeout_s for one) and the server's /version answer (None without one)."""
    async with httpx.AsyncClient(
        base_url=config.base_url, headers=auth_headers(config.api_key)
    ) as client:
        deadline = time.monotonic() + config.ready_timeout_s
        last_error = ""
        while config.model is None and time.monotonic() < deadline:
            try:
                response = await client.get("/v1/models", timeout=10)
                if response.status_code == 200 and response.json().get("data"):
                    config = replace(config, model=str(response.json()["data"][0]["id"]))
                    break
                last_error = f"HTTP {response.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            await anyio.sleep(0.5)
        if config.model is None:
            raise ServerUnavailableError(
                f"no model listed at {config.base_url}/v1/models "
                f"within {config.ready_timeout_s:g} s ({last_error})"
            )
        try:
            response = await client.get("/version", timeout=10)
            version = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            version = None
        return config.model, version


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The server's own view of the run: GPU idle, preemptions."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERVER_METRICS:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found
