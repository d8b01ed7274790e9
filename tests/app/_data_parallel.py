"""Driving `tandem serve --data-parallel-size N` from a test: which engine core served a
request (the per-core `engine` label of /metrics), a chat turn, the cores' pids."""

from __future__ import annotations

import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.app._serve_process import ServeProcess

BLOCK_SIZE = 16


def by_core(url: str, name: str, num_cores: int = 2, **labels: str) -> list[float]:
    """The samples `name` of each core that carry `labels` (summed over their other
    labels), from /metrics."""
    counts = [0.0] * num_cores
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                counts[int(sample.labels["engine"])] += sample.value
    return counts


def finished_by_core(url: str, num_cores: int = 2) -> list[float]:
    """vllm:request_success_total per core (every finish reason)."""
    return by_core(url, "vllm:request_success_total", num_cores)


def core_of_next_request(url: str, send: Any, num_cores: int = 2) -> tuple[int, Any]:
    """(the core that served it, what `send()` returned) for one request sent alone."""
    before = finished_by_core(url, num_cores)
    result = send()
    after = finished_by_core(url, num_cores)
    moved = [core for core in range(num_cores) if after[core] != before[core]]
    assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1, (before, after)
    return moved[0], result


def chat(client: httpx.Client | str, messages: list[dict[str, str]], **extra: Any) -> Any:
    """One greedy chat completion's JSON (`client`: a client or the server's URL)."""
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, **extra}
    if isinstance(client, str):
        response = httpx.post(client + "/v1/chat/completions", json=body, timeout=120)
    else:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def engine_pids(server: ServeProcess, num_cores: int = 2) -> list[int]:
    """The cores' pids, from their log lines (process engine_core_<i>)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = {
            int(line["process"].rsplit("_", 1)[1]): int(line["pid"])
            for line in server.lines()
            if str(line.get("process", "")).startswith("engine_core_")
        }
        if len(pids) == num_cores:
            return [pids[core] for core in range(num_cores)]
        time.sleep(0.1)
    raise AssertionError("the engine cores did not log")
