"""The load generators of benchmarks.serve: one client's share of a level (its prompts, warmup
prompts and concurrency), run in this process or in one spawned process per share that start
together, and the arrival clock (all at once, or Poisson) each client sends its prompts on.
benchmarks.multi_turn runs its conversations through the same processes."""

from __future__ import annotations

import math
import multiprocessing
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from queue import Empty
from typing import Any

import anyio
import httpx

from benchmarks.serve_config import ServeConfig
from benchmarks.serve_metrics import RequestResult
from benchmarks.server_process import ServerUnavailableError
from benchmarks.stream_client import auth_headers, stream_request
from benchmarks.workloads import ENDPOINT_PATHS, ServeWorkload, request_body


@dataclass(frozen=True, slots=True)
class Share:
    index: int
    prompts: list[Any]
    warmup_prompts: list[Any]
    concurrency: int


@dataclass(frozen=True, slots=True)
class ClientOutcome:
    results: list[RequestResult]
    started_s: float
    """time.monotonic(), one clock for every process of the machine."""
    ended_s: float


def even_share(total: int, parts: int, index: int) -> int:
    """Part `index` of `total` split over `parts` as evenly as whole numbers allow."""
    return total // parts + (1 if index < total % parts else 0)


def in_processes(
    config: ServeConfig, model: str, shares: list[Share], client: Any = None
) -> list[ClientOutcome]:
    """One process per share; they warm up, wait for each other, then run together.
    `client`: the coroutine function each process runs (default `run_client`; another
    benchmark's, e.g. benchmarks.multi_turn, with its own config and shares)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(shares))
    queue = context.Queue()
    processes = [
        context.Process(
            target=_client_process,
            args=(config, model, share, barrier, queue, client or run_client),
            daemon=True,
        )
        for share in shares
    ]
    for process in processes:
        process.start()
    answers: list[ClientOutcome | str] = []
    while len(answers) < len(processes):
        try:
            answers.append(queue.get(timeout=1.0))
        except Empty:
            if any(p.exitcode not in (None, 0) for p in processes):
                barrier.abort()
                answers.append("a client process died without an answer")
    for process in processes:
        process.join(timeout=60)
    errors = [a for a in answers if isinstance(a, str)]
    if errors:
        raise ServerUnavailableError(errors[0])
    return answers  # type: ignore[return-value]


def _client_process(
    config: ServeConfig, model: str, share: Share, barrier: Any, queue: Any, client: Any = None
) -> None:
    try:
        queue.put(anyio.run(client or run_client, config, model, share, barrier))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        barrier.abort()
        queue.put(f"client {share.index}: {type(exc).__name__}: {exc}")


async def run_client(config: ServeConfig, model: str, share: Share, barrier: Any) -> ClientOutcome:
    """One client's share of a level: its warmup prompts, then (after every client's
    warmup, where `barrier` is given) its measured prompts."""
    workload = config.workload
    limits = httpx.Limits(
        max_connections=share.concurrency + 8, max_keepalive_connections=share.concurrency + 8
    )
    async with httpx.AsyncClient(
        base_url=config.base_url,
        limits=limits,
        timeout=httpx.Timeout(config.timeout_s, connect=30.0),
        headers=auth_headers(config.api_key),
    ) as client:
        if share.warmup_prompts:
            warm = await _run_requests(
                client,
                workload,
                model,
                share.warmup_prompts,
                min(share.concurrency, len(share.warmup_prompts)),
                math.inf,
                workload.seed,
            )
            failed = [r for r in warm if not r.success]
            if failed:
                raise ServerUnavailableError(
                    f"{len(failed)} of {len(warm)} warmup requests failed: {failed[0].error}"
                )
        if barrier is not None:
            await anyio.to_thread.run_sync(barrier.wait)
        started = time.monotonic()
        results = await _run_requests(
            client,
            workload,
            model,
            share.prompts,
            share.concurrency,
            config.request_rate / config.clients,
            workload.seed + share.index,
        )
        return ClientOutcome(results, started, time.monotonic())


async def _run_requests(
    client: httpx.AsyncClient,
    workload: ServeWorkload,
    model: str,
    prompts: Sequence[Any],
    concurrency: int,
    request_rate: float,
    seed: int,
) -> list[RequestResult]:
    path = ENDPOINT_PATHS[workload.endpoint]
    arrivals_s = arrival_offsets_s(len(prompts), request_rate, seed)
    limiter = anyio.Semaphore(concurrency)
    results: list[RequestResult | None] = [None] * len(prompts)
    started = time.perf_counter()

    async def one(index: int) -> None:
        await anyio.sleep(max(0.0, started + arrivals_s[index] - time.perf_counter()))
        async with limiter:
            results[index] = await stream_request(
                client, path, request_body(workload, prompts[index], model),
                by_text=workload.time_by_text,
            )  # fmt: skip

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
