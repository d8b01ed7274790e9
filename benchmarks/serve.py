"""Serving under load: streamed requests against a running OpenAI-compatible server, measured
as `vllm bench serve` measures them (TTFT, TPOT, ITL, E2EL: benchmarks.serve_metrics).

    # the streamed chat of the acceptance runs (H200): real tokenizer, four client processes
    python -m benchmarks.serve --result serve_chat --server "--model dummy:qwen3-0.6b \\
        --tokenizer .tok/qwen3 --max-num-seqs 256 --max-num-batched-tokens 16384 \\
        --gpu-memory-utilization 0.85 --max-queued-requests 8192 --api-server-count 4" \\
        --endpoint chat --tokenizer .tok/qwen3 --input-len 128 --output-len 512 --ignore-eos \\
        --temperature 1.0 --concurrency 256 --num-prompts 1024 --warmup 32 --clients 4
    # the embedded model on the CPU
    python -m benchmarks.serve --result serve_cpu --server "--device cpu --dtype float32 \\
        --max-num-seqs 64 --no-prefix-caching" --num-prompts 64 --input-len 128 \\
        --output-len 64 --concurrency 1,16,64 --warmup 4 --ignore-eos

`--server ARGS` starts `tandem serve ARGS` on a free port for the run and stops it after;
`--base-url` measures a server already running. Each concurrency level runs `--warmup`
unmeasured requests, then the measured prompts: all sent at t=0 (request rate inf) or on a
seeded Poisson clock, at most `concurrency` in flight. One Python client process tops out
near 40k streamed tokens/s (benchmarks/NOTES.md), so `--clients N` splits each level's
prompts and concurrency over N processes that start together; their requests are pooled
and the level's time runs from the first client's start to the last one's end.

Every level sends the same prompts (as vLLM does); against a server with prefix caching,
later levels may skip prefill, which `total_cached_prompt_tokens` shows.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from queue import Empty
from typing import Any

import anyio
import httpx
import orjson

from benchmarks import recording
from benchmarks.serve_metrics import RequestResult, StreamTimeline, summarize
from benchmarks.workloads import (
    DEFAULT_TOKEN_ID_RANGE,
    ENDPOINT_PATHS,
    ServeWorkload,
    prompts_digest,
    request_body,
    serve_prompts,
)

WARMUP_SEED_OFFSET = 1_000_003
"""Warmup prompts come from another seed, so they never prefill-cache the measured ones."""
SERVER_READY_TIMEOUT_S = 600.0
SERVER_METRICS = ("tandem:gpu_idle_fraction", "vllm:num_preemptions_total")


class ServerUnavailableError(RuntimeError):
    """The server did not answer /v1/models in time, or its warmup requests failed."""


@dataclass(frozen=True, slots=True)
class ServeConfig:
    base_url: str
    workload: ServeWorkload
    concurrencies: tuple[int, ...]
    request_rate: float = math.inf
    num_warmups: int = 0
    clients: int = 1
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 3600.0
    ready_timeout_s: float = 60.0


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("serve", __doc__)
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="a running server's root, without /v1 (default %(default)s)",
    )
    target.add_argument(
        "--server", metavar="ARGS", help="start `tandem serve ARGS` on a free port for this run"
    )
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="completions sends random token-id prompts of exactly --input-len "
        "tokens; chat sends text of --input-len words, or with --tokenizer of "
        "exactly --input-len tokens (default completions)",
    )
    p.add_argument(
        "--tokenizer",
        help="chat: the server's tokenizer (tokenizer.json or a "
        "Hugging Face directory) to size messages in tokens",
    )
    p.add_argument("--model", help="model name to send (default: the first in /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=64, help="measured requests per level")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument(
        "--concurrency",
        default="1",
        help="comma-separated most-in-flight counts, one level each (default 1)",
    )
    p.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s on a Poisson clock, or inf: all sent at once (default)",
    )
    p.add_argument(
        "--warmup", type=int, default=0, help="unmeasured requests before each level (default 0)"
    )
    p.add_argument(
        "--clients",
        type=int,
        default=1,
        help="client processes sharing each level (default 1; 4 above ~40k tok/s)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly --output-len tokens per request"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--token-id-range",
        default="{}:{}".format(*DEFAULT_TOKEN_ID_RANGE),
        help="LOW:HIGH range of the random prompt token ids (default %(default)s)",
    )
    p.add_argument(
        "--response-format",
        metavar="JSON",
        help='response_format of every request, e.g. \'{"type": "json_object"}\' '
        "(or @FILE holding it)",
    )
    p.add_argument(
        "--extra-body",
        metavar="JSON",
        help='fields merged into every request body last, e.g. \'{"logit_bias": {"2": -100}}\' '
        "(or @FILE holding them)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    args = p.parse_args(argv)
    try:
        args.config = config_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def config_from_args(args: Any) -> ServeConfig:
    """The run's configuration; ValueError names the flag that is wrong."""
    concurrencies = _positive_ints(args.concurrency, "--concurrency")
    for name, value, least in (
        ("--num-prompts", args.num_prompts, 1),
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 1),
        ("--warmup", args.warmup, 0),
        ("--clients", args.clients, 1),
    ):
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if args.clients > min(concurrencies + (args.num_prompts,)):
        raise ValueError(
            f"--clients {args.clients} is more than the smallest concurrency or "
            "--num-prompts: every client needs a request in flight"
        )
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    workload = ServeWorkload(
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        token_id_range=_token_range(args.token_id_range),
        tokenizer=args.tokenizer,
        response_format=_json_object(args.response_format),
        extra_body=_json_object(getattr(args, "extra_body", None), "--extra-body"),
    )
    return ServeConfig(
        base_url=base_url,
        workload=workload,
        concurrencies=concurrencies,
        request_rate=_request_rate(args.request_rate),
        num_warmups=args.warmup,
        clients=args.clients,
        model=args.model,
        api_key=args.api_key,
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config: ServeConfig = args.config
    workload = {
        **asdict(config.workload),
        "concurrencies": list(config.concurrencies),
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "warmup_per_level": config.num_warmups,
        "clients": config.clients,
        "server": f"tandem serve {args.server}" if args.server else config.base_url,
    }
    run = recording.Run("serve", args, "serve", workload, argv)
    with _server(args.server) as base_url:
        if base_url is not None:
            config = ServeConfig(
                **{
                    **_fields(config),
                    "base_url": base_url,
                    "ready_timeout_s": SERVER_READY_TIMEOUT_S,
                }
            )
        details = run_levels(config, run.checkpoint)
        if base_url is not None:
            details["server_metrics"] = scrape_metrics(base_url)
    record = run.finish(headline(details["levels"]), details)
    for level in record["details"]["levels"]:
        print(describe_level(level), flush=True)
    return 0 if all(level["failed"] == 0 for level in details["levels"]) else 1


def run_levels(config: ServeConfig, checkpoint: Any = None) -> dict[str, Any]:
    """Run every concurrency level against the server; returns what it measured."""
    prompts = serve_prompts(config.workload, config.workload.seed)
    model, version = anyio.run(_model_and_version, config)
    details: dict[str, Any] = {
        "base_url": config.base_url,
        "endpoint": ENDPOINT_PATHS[config.workload.endpoint],
        "model": model,
        "server_version": version,
        "prompts_sha256_16": prompts_digest(prompts),
        "warmup_seed": config.workload.seed + WARMUP_SEED_OFFSET,
        "levels": [],
    }
    for concurrency in config.concurrencies:
        details["levels"].append(run_level(config, model, prompts, concurrency))
        if checkpoint is not None:
            checkpoint(details)
    return details


def run_level(
    config: ServeConfig, model: str, prompts: list[Any], concurrency: int
) -> dict[str, Any]:
    workload = config.workload
    warm = (
        serve_prompts(workload, workload.seed + WARMUP_SEED_OFFSET, config.num_warmups)
        if config.num_warmups
        else []
    )
    shares = [
        _Share(
            index,
            prompts[index :: config.clients],
            warm[index :: config.clients],
            _split(concurrency, config.clients, index),
        )
        for index in range(config.clients)
    ]
    load_before = recording.load_average()
    if config.clients == 1:
        outcomes = [anyio.run(_client, config, model, shares[0], None)]
    else:
        outcomes = _in_processes(config, model, shares)
    results = [r for outcome in outcomes for r in outcome.results]
    duration_s = max(o.ended_s for o in outcomes) - min(o.started_s for o in outcomes)
    expected = workload.output_len if workload.ignore_eos else None
    return {
        "concurrency": concurrency,
        "clients": config.clients,
        "load_average_before": load_before,
        "load_average_after": recording.load_average(),
        **summarize(results, duration_s, expected),
    }


def headline(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures `benchmarks.report` compares between results, per level."""
    figures: dict[str, Any] = {}
    for level in levels:
        at = f"c{level['concurrency']}"
        figures[f"{at}_output_tok_s"] = round(level["output_throughput_tok_s"], 1)
        for metric, stat in (
            ("ttft", "median_ms"),
            ("ttft", "p99_ms"),
            ("tpot", "median_ms"),
            ("itl", "median_ms"),
        ):
            value = level[metric][stat]
            figures[f"{at}_{metric}_{stat}"] = None if value is None else round(value, 2)
        figures[f"{at}_failed"] = level["failed"]
    return figures


# ---- client processes ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Share:
    index: int
    prompts: list[Any]
    warmup_prompts: list[Any]
    concurrency: int


@dataclass(frozen=True, slots=True)
class _ClientOutcome:
    results: list[RequestResult]
    started_s: float
    """time.monotonic(), one clock for every process of the machine."""
    ended_s: float


def _split(total: int, parts: int, index: int) -> int:
    return total // parts + (1 if index < total % parts else 0)


def _in_processes(
    config: ServeConfig, model: str, shares: list[_Share], client: Any = None
) -> list[_ClientOutcome]:
    """One process per share; they warm up, wait for each other, then run together.
    `client`: the coroutine function each process runs (default `_client`; another
    benchmark's, e.g. benchmarks.multi_turn, with its own config and shares)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(shares))
    queue = context.Queue()
    processes = [
        context.Process(
            target=_client_process,
            args=(config, model, share, barrier, queue, client or _client),
            daemon=True,
        )
        for share in shares
    ]
    for process in processes:
        process.start()
    answers: list[_ClientOutcome | str] = []
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
    config: ServeConfig, model: str, share: _Share, barrier: Any, queue: Any, client: Any = None
) -> None:
    try:
        queue.put(anyio.run(client or _client, config, model, share, barrier))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        barrier.abort()
        queue.put(f"client {share.index}: {type(exc).__name__}: {exc}")


async def _client(config: ServeConfig, model: str, share: _Share, barrier: Any) -> _ClientOutcome:
    workload = config.workload
    limits = httpx.Limits(
        max_connections=share.concurrency + 8, max_keepalive_connections=share.concurrency + 8
    )
    async with httpx.AsyncClient(
        base_url=config.base_url,
        limits=limits,
        timeout=httpx.Timeout(config.timeout_s, connect=30.0),
        headers=_auth_headers(config.api_key),
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
        return _ClientOutcome(results, started, time.monotonic())


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


async def stream_request(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    on_event: Callable[[dict[str, Any]], None] | None = None,
    by_text: bool = False,
) -> RequestResult:
    """POST one streamed request and time its SSE events; never raises for a bad answer.
    `on_event` also sees every decoded event (benchmarks.multi_turn keeps the text);
    `by_text`: see StreamTimeline."""
    timeline = StreamTimeline(sent_s=time.perf_counter(), by_text=by_text)
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
                at_s, event = time.perf_counter(), orjson.loads(data)
                timeline.on_event(at_s, event)
                if on_event is not None:
                    on_event(event)
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        return RequestResult(success=False, error=f"{type(exc).__name__}: {exc}")
    return timeline.result()


# ---- the server -----------------------------------------------------------------------------


async def _model_and_version(config: ServeConfig) -> tuple[str, Any]:
    async with httpx.AsyncClient(
        base_url=config.base_url, headers=_auth_headers(config.api_key)
    ) as client:
        deadline = time.monotonic() + config.ready_timeout_s
        last_error = ""
        while config.model is None and time.monotonic() < deadline:
            try:
                response = await client.get("/v1/models", timeout=10)
                if response.status_code == 200 and response.json().get("data"):
                    config = ServeConfig(
                        **{**_fields(config), "model": str(response.json()["data"][0]["id"])}
                    )
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


@contextmanager
def _server(server_args: str | None) -> Iterator[str | None]:
    """`tandem serve ARGS` on a free port until the block ends (None: no server to start)."""
    if server_args is None:
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
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
        while not _healthy(base_url):
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


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


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


# ---- arguments and output -------------------------------------------------------------------


def describe_level(level: dict[str, Any]) -> str:
    def ms(metric: str, stat: str) -> str:
        value = level[metric][stat]
        return "-" if value is None else f"{value:.1f}"

    return (
        f"concurrency {level['concurrency']}: {level['completed']} ok, "
        f"{level['failed']} failed, {level['output_throughput_tok_s']:.1f} output tok/s, "
        f"{level['request_throughput_req_s']:.2f} req/s | ms median/p99: "
        f"TTFT {ms('ttft', 'median_ms')}/{ms('ttft', 'p99_ms')} "
        f"TPOT {ms('tpot', 'median_ms')}/{ms('tpot', 'p99_ms')} "
        f"ITL {ms('itl', 'median_ms')}/{ms('itl', 'p99_ms')} "
        f"E2EL {ms('e2el', 'median_ms')}/{ms('e2el', 'p99_ms')}"
        + (f" | first error: {level['errors'][0]}" if level.get("errors") else "")
    )


def _fields(config: ServeConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in ServeConfig.__slots__}


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def _request_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not rate > 0:
        raise ValueError(f"--request-rate must be 'inf' or a positive number, got {text!r}")
    return rate


def _token_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        low = high = -1
    if not 0 <= low < high:
        raise ValueError(f"--token-id-range must be LOW:HIGH with 0 <= LOW < HIGH, got {text!r}")
    return low, high


def _json_object(text: str | None, flag: str = "--response-format") -> dict[str, Any] | None:
    if text is None:
        return None
    if text.startswith("@"):
        text = Path(text[1:]).read_text(encoding="utf-8")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


if __name__ == "__main__":
    sys.exit(main())
