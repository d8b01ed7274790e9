"""A storm of streams on shared CPUs (issue 32, item 8): many streaming chat clients at once,
half of them hanging up after their first chunk, while one busy process per CPU competes
with the server; then one fresh request.

    # the issue's storm against `tandem serve` defaults (the embedded model on the CPU)
    python -m benchmarks.storm --clients 300 --max-tokens 32 --hogs-per-cpu 1

Reported: how each client ended (completed, hung_up, timeout after `--client-timeout`,
status N, error event), TTFT and completion time percentiles of the readers, the slowest
/health answer during the storm (polled every 50 ms), and the fresh request's seconds.
The issue's bar: 0 timeouts and the fresh request within 2 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from benchmarks import recording
from benchmarks.server_process import tandem_server

PROMPT = "Tell me a short story about a lighthouse."


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("storm", __doc__)
    p.add_argument("--server-args", default="", help="`tandem serve` arguments (default none)")
    p.add_argument("--clients", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--client-timeout", type=float, default=60.0, help="seconds per client")
    p.add_argument("--hogs-per-cpu", type=int, default=1, help="busy processes per usable CPU")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    num_hogs = args.hogs_per_cpu * len(os.sched_getaffinity(0))
    workload = {
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "hogs": num_hogs,
        "client_timeout_s": args.client_timeout,
        "server_args": args.server_args,
        "prompt": PROMPT,
        "hang_up": "every second client after its first chunk",
    }
    run = recording.Run("storm", args, "storm", workload, argv)
    with tandem_server(args.server_args) as base_url:
        assert base_url is not None
        with busy_processes(num_hogs), _HealthPoll(base_url) as health:
            outcomes = asyncio.run(_storm(base_url, args))
            started = time.monotonic()
            fresh = httpx.post(
                base_url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
                timeout=args.client_timeout,
            )
            fresh_s = time.monotonic() - started
    details = summarize(outcomes)
    details.update(
        fresh_request_s=round(fresh_s, 3),
        fresh_status=fresh.status_code,
        health_max_s=round(health.max_s, 3),
        health_failures=health.failures,
    )
    figures = {k: details[k] for k in ("timeouts", "completed", "fresh_request_s", "health_max_s")}
    run.finish(figures, details)
    print(json.dumps(details, indent=1))
    return 0


def summarize(outcomes: list[tuple[str, float | None, float]]) -> dict[str, Any]:
    """outcomes: (how it ended, TTFT s or None, seconds to its end)."""
    ends = Counter(end for end, _, _ in outcomes)
    readers = [(ttft, took) for end, ttft, took in outcomes if end == "completed"]
    return {
        "ends": dict(ends),
        "completed": ends["completed"],
        "timeouts": ends["timeout"],
        "ttft_s": _percentiles([t for t, _ in readers if t is not None]),
        "completion_s": _percentiles([took for _, took in readers]),
    }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
    }


async def _storm(base_url: str, args: Any) -> list[tuple[str, float | None, float]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        return list(
            await asyncio.gather(*(_client(http, i % 2 == 1, args) for i in range(args.clients)))
        )


async def _client(
    http: httpx.AsyncClient, hang_up: bool, args: Any
) -> tuple[str, float | None, float]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
            "stream": True}  # fmt: skip
    started, ttft = time.monotonic(), None
    try:
        async with asyncio.timeout(args.client_timeout):
            async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                if reply.status_code != 200:
                    return f"status {reply.status_code}", None, time.monotonic() - started
                async for line in reply.aiter_lines():
                    if line == "data: [DONE]":
                        return "completed", ttft, time.monotonic() - started
                    if line.startswith("data: {"):
                        if "error" in json.loads(line[6:]):
                            return "error event", ttft, time.monotonic() - started
                        ttft = ttft if ttft is not None else time.monotonic() - started
                        if hang_up:
                            return "hung_up", ttft, time.monotonic() - started
                return "ended without [DONE]", ttft, time.monotonic() - started
    except TimeoutError:
        return "timeout", ttft, time.monotonic() - started


class _HealthPoll:
    """Polls /health every 50 ms on a thread; keeps the slowest answer and any failure."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.max_s = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _HealthPoll:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=10) as http:
            while not self._stop.wait(0.05):
                started = time.monotonic()
                try:
                    status = http.get("/health").status_code
                except httpx.HTTPError as exc:
                    self.failures.append(type(exc).__name__)
                    continue
                self.max_s = max(self.max_s, time.monotonic() - started)
                if status != 200:
                    self.failures.append(f"status {status}")


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU until the block ends (the "shared CPUs")."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


if __name__ == "__main__":
    sys.exit(main())
