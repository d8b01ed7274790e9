"""`tandem bench serve`: load a running OpenAI-compatible server with streamed requests and
measure TTFT, TPOT, ITL and E2EL the way `vllm bench serve` does (see serve_metrics).

Each concurrency level runs `num_warmups` unmeasured requests, then the measured prompts:
all arrive at t=0 (request rate inf) or on a seeded Poisson clock, and at most
`concurrency` are in flight. The JSON result is rewritten after every level.

Every level sends the same prompts (as vLLM does); against a server with prefix caching,
later levels may skip prefill, which `total_cached_prompt_tokens` shows.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson

from benchmarks.run_info import load_average, run_header
from benchmarks.serve_metrics import RequestResult, StreamTimeline, summarize
from benchmarks.serve_workload import (
    ENDPOINT_PATHS,
    Workload,
    prompts_digest,
    prompts_for,
    request_body,
)

WARMUP_SEED_OFFSET = 1_000_003
"""Warmup prompts come from another seed, so they never prefill-cache the measured ones."""


class ServerUnavailableError(RuntimeError):
    """The server did not answer /v1/models in time."""


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    base_url: str
    workload: Workload
    concurrencies: tuple[int, ...]
    request_rate: float = math.inf
    num_warmups: int = 0
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 3600.0
    ready_timeout_s: float = 60.0


def run_serve_benchmark(config: ServeBenchConfig, command: str,
                        output: Path | None = None) -> dict[str, Any]:
    """Run every concurrency level against the server; returns (and writes) the record."""
    return anyio.run(_run_benchmark, config, command, output)


async def _run_benchmark(config: ServeBenchConfig, command: str,
                         output: Path | None) -> dict[str, Any]:
    workload = config.workload
    prompts = prompts_for(workload, workload.seed)
    record: dict[str, Any] = {
        "benchmark": "serve", **run_header(command),
        "base_url": config.base_url, "endpoint": ENDPOINT_PATHS[workload.endpoint],
        "workload": {**asdict(workload), "prompts_sha256_16": prompts_digest(prompts)},
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "warmup": {"num_requests_per_level": config.num_warmups,
                   "seed": workload.seed + WARMUP_SEED_OFFSET},
        "levels": []}
    limits = httpx.Limits(max_connections=max(config.concurrencies) + 8,
                          max_keepalive_connections=max(config.concurrencies) + 8)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=config.base_url, limits=limits, timeout=timeout,
                                 headers=_auth_headers(config.api_key)) as client:
        model = config.model or await _wait_for_model(client, config.ready_timeout_s)
        record["model"] = model
        record["server_version"] = await _server_version(client)
        for concurrency in config.concurrencies:
            level = await _run_level(client, config, model, prompts, concurrency)
            record["levels"].append(level)
            _write(output, record)
    record["load_average_after"] = load_average()
    _write(output, record)
    return record


async def _run_level(client: httpx.AsyncClient, config: ServeBenchConfig, model: str,
                     prompts: list[Any], concurrency: int) -> dict[str, Any]:
    workload = config.workload
    if config.num_warmups:
        warm_prompts = prompts_for(workload, workload.seed + WARMUP_SEED_OFFSET, config.num_warmups)
        warm = await _run_requests(client, workload, model, warm_prompts,
                                   min(concurrency, config.num_warmups), math.inf, workload.seed)
        failed = [r for r in warm if not r.success]
        if failed:
            raise ServerUnavailableError(f"{len(failed)} of {len(warm)} warmup requests failed: "
                                         f"{failed[0].error}")
    load_before = load_average()
    started = time.perf_counter()
    results = await _run_requests(client, workload, model, prompts, concurrency,
                                  config.request_rate, workload.seed)
    duration_s = time.perf_counter() - started
    expected = workload.output_len if workload.ignore_eos else None
    return {"concurrency": concurrency, "load_average_before": load_before,
            "load_average_after": load_average(), **summarize(results, duration_s, expected)}


async def _run_requests(client: httpx.AsyncClient, workload: Workload, model: str,
                        prompts: Sequence[Any], concurrency: int, request_rate: float,
                        seed: int) -> list[RequestResult]:
    path = ENDPOINT_PATHS[workload.endpoint]
    arrivals_s = arrival_offsets_s(len(prompts), request_rate, seed)
    limiter = anyio.Semaphore(concurrency)
    results: list[RequestResult | None] = [None] * len(prompts)
    started = time.perf_counter()

    async def one(index: int) -> None:
        await anyio.sleep(max(0.0, started + arrivals_s[index] - time.perf_counter()))
        async with limiter:
            body = request_body(workload, prompts[index], model)
            results[index] = await stream_request(client, path, body)

    async with anyio.create_task_group() as tg:
        for index in range(len(prompts)):
            tg.start_soon(one, index)
    return [r for r in results if r is not None]


def arrival_offsets_s(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times after the start: all 0 for rate inf, else a Poisson process of that rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The response's lines as Server-Sent Events end them: at LF or CRLF. (httpx's
    aiter_lines also ends a line at U+2028, U+2029 and U+0085, which a JSON string may
    hold unescaped: it would cut such an event in two.)"""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> RequestResult:
    """POST one streamed request and time its SSE events; never raises for a bad answer."""
    timeline = StreamTimeline(sent_s=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return RequestResult(success=False, error=f"HTTP {response.status_code}: {detail}")
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue  # blank separators and ': keep-alive' comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                timeline.on_event(time.perf_counter(), orjson.loads(data))
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        return RequestResult(success=False, error=f"{type(exc).__name__}: {exc}")
    return timeline.result()


async def _wait_for_model(client: httpx.AsyncClient, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while time.monotonic() < deadline:
        try:
            response = await client.get("/v1/models", timeout=10)
            if response.status_code == 200 and response.json().get("data"):
                return str(response.json()["data"][0]["id"])
            last_error = f"HTTP {response.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        await anyio.sleep(0.5)
    raise ServerUnavailableError(f"no model listed at {client.base_url.join('/v1/models')} within "
                                 f"{timeout_s:g} s ({last_error})")


async def _server_version(client: httpx.AsyncClient) -> Any:
    try:
        response = await client.get("/version", timeout=10)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _write(output: Path | None, record: dict[str, Any]) -> None:
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
