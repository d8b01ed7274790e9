"""A real Prometheus 2.x (Debian bookworm's `prometheus` package, unpacked with `dpkg -x`
into the pytest cache, so it is fetched once per checkout) scrapes a served tandem on
loopback; the series come back through Prometheus' HTTP API under their colon names
(vLLM's, old ones included), with the values the server exported."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow

PACKAGE = "prometheus"
SCRAPE_INTERVAL_S = 1
START_TIMEOUT_S = 30.0
SERIES_TIMEOUT_S = 15.0
NUM_REQUESTS, MAX_TOKENS = 3, 6


@pytest.fixture(scope="module")
def prometheus_binary(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Debian's prometheus binary: downloaded with `apt-get download` (no root needed) and
    unpacked with `dpkg -x` the first time, then taken from the pytest cache (a temporary
    folder when the cache is off)."""
    cache = getattr(request.config, "cache", None)
    folder = (
        cache.mkdir("debian-prometheus")
        if cache is not None
        else tmp_path_factory.mktemp("debian-prometheus")
    )
    cached = Path(folder) / "prometheus"
    if cached.is_file():
        return cached
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        pytest.skip("apt-get and dpkg are needed to fetch Debian's prometheus package")
    # A folder of its own, and an atomic rename at the end: another session of the same
    # checkout may be fetching it too.
    work = Path(tempfile.mkdtemp(prefix="download-", dir=cached.parent))
    try:
        download = _run(["apt-get", "download", PACKAGE], work)
        if download.returncode != 0:
            pytest.skip(
                f"apt-get download {PACKAGE} failed (no package lists or no mirror?): "
                f"{download.stderr.strip()[-500:]}"
            )
        [deb] = work.glob(f"{PACKAGE}_*.deb")
        unpack = _run(["dpkg", "-x", str(deb), "root"], work)
        assert unpack.returncode == 0, unpack.stderr
        os.replace(work / "root/usr/bin/prometheus", cached)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return cached


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def prometheus(
    prometheus_binary: Path, server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The URL of a Prometheus that scrapes `server` every second."""
    work = tmp_path_factory.mktemp("prometheus")
    target = server.url.removeprefix("http://")
    (work / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
        f"scrape_configs:\n  - job_name: tandem\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = _free_port()
    with (work / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [
                str(prometheus_binary),
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, work / "prometheus.log")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"prometheus did not become ready:\n{log.read_text()[-3000:]}")


def _query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    response = httpx.get(prometheus + "/api/v1/query", params={"query": promql}, timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _value_when(prometheus: str, promql: str, expected: float) -> float:
    """The query's one value, once it equals `expected` or SERIES_TIMEOUT_S has passed."""
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while True:
        result = _query(prometheus, promql)
        value = float(result[0]["value"][1]) if len(result) == 1 else None
        if value == expected or time.monotonic() > deadline:
            assert value is not None, (promql, result)
            return value
        time.sleep(0.2)


def _served_value(server: RunningServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    raise AssertionError(f"{name} {labels} not served")


def test_prometheus_reads_the_vllm_series_back_under_their_colon_names(
    prometheus: str, server: RunningServer
) -> None:
    for _ in range(NUM_REQUESTS):
        response = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=60,
            json={
                "messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
            },
        )
        assert response.status_code == 200, response.text
    server.wait_engine_idle()
    generated = _served_value(server, "vllm:generation_tokens_total")
    inter_token_gaps = _served_value(server, "vllm:inter_token_latency_seconds_count")
    assert generated >= NUM_REQUESTS * MAX_TOKENS and inter_token_gaps > 0

    assert _value_when(prometheus, 'up{job="tandem"}', 1) == 1
    assert _value_when(prometheus, "vllm:generation_tokens_total", generated) == generated
    finished = 'vllm:request_success_total{finished_reason="length"}'
    assert _value_when(prometheus, finished, NUM_REQUESTS) == NUM_REQUESTS
    for histogram in ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"):
        count = _value_when(prometheus, histogram + "_count", inter_token_gaps)
        assert count == inter_token_gaps
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert _value_when(prometheus, gauge, 0) == 0
    for usage in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        [series] = _query(prometheus, usage)
        assert series["metric"]["model_name"] == server.state.model_names[0]
        assert 0 <= float(series["value"][1]) <= 1
    # The colons survived the OpenMetrics exposition Prometheus 2.x negotiates.
    assert _query(prometheus, '{__name__=~"vllm_.+"}') == []
