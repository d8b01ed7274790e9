"""Soak: the real server with the embedded model on CPU under a mixed, misbehaving load.

    python -m benchmarks.soak --requests 2000 --concurrency 128 --threads 2

`concurrency` clients send a seeded mix (see benchmarks.soak_workload): streamed and
non-streamed chat and text completions with random lengths and sampling parameters, a
share of clients that disconnect at a random moment, a share of malformed requests.
The run passes when no request failed (no 5xx, every accepted request completed with a
correct finish_reason and token count or was aborted by its own client), when afterwards
`/metrics` shows nothing running or waiting and an empty KV cache, the engine's KV pool and
runner rows are free and the KV cache manager's invariants hold, and when resident memory
grew by at most `max_rss_growth_mib` over the second half of the run.
The CI test (tests/benchmarks/test_soak.py) runs the same code, smaller.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.server_state import EngineSnapshot
from benchmarks import recording
from benchmarks.soak_client import REQUEST_TIMEOUT_S, RequestOutcome, send
from benchmarks.soak_server import RssSampler
from benchmarks.soak_workload import SoakMix, plan_request

_MIB = 1024 * 1024
_MAX_FAILURES_LISTED = 20


@dataclass(frozen=True, slots=True)
class SoakConfig:
    num_requests: int = 150
    concurrency: int = 32
    seed: int = 0
    mix: SoakMix = field(default_factory=SoakMix)
    max_rss_growth_mib: float = 256.0
    """Allowed RSS growth between the middle and the end of the run."""
    idle_timeout_s: float = 60.0


class SoakTarget(Protocol):
    url: str
    pid: int

    def wait_idle(self, timeout_s: float) -> EngineSnapshot: ...

    def check_kv_invariants(self) -> None: ...


@dataclass(slots=True)
class _Progress:
    num_done: int = 0


def run_soak(target: SoakTarget, config: SoakConfig, api_key: str | None = None) -> dict[str, Any]:
    """Drive the load, then check the server; returns the report (`passed`, `problems`)."""
    progress = _Progress()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reasons_before = _finish_reason_counts(_scrape(target.url))
    started = time.monotonic()
    with RssSampler(target.pid, lambda: progress.num_done) as rss:
        outcomes = anyio.run(_drive, target.url, config, headers, progress)
    elapsed_s = time.monotonic() - started
    target.wait_idle(config.idle_timeout_s)
    _flush_finished_rows(target.url, headers)
    snapshot = target.wait_idle(config.idle_timeout_s)
    metrics = _scrape(target.url)
    invariants = "ok"
    try:
        target.check_kv_invariants()
    except AssertionError as exc:
        invariants = f"broken: {exc}"
    reasons_after = _finish_reason_counts(metrics)
    report = {
        "config": dataclasses.asdict(config),
        "elapsed_s": round(elapsed_s, 2),
        "requests_per_s": round(len(outcomes) / elapsed_s, 2),
        "outcomes": dict(Counter(o.outcome for o in outcomes)),
        "outcomes_by_plan": _by_plan(outcomes),
        "client_aborts": dict(
            Counter(
                "mid-stream" if o.detail.startswith("after") else "before any output"
                for o in outcomes
                if o.outcome == "client_aborted"
            )
        ),
        "num_5xx": sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        "num_output_tokens": sum(o.num_output_tokens for o in outcomes),
        "client_finish_reasons": dict(Counter(r for o in outcomes for r in o.finish_reasons)),
        "server_finish_reasons": {
            r: reasons_after[r] - reasons_before.get(r, 0) for r in reasons_after
        },
        "latency_s": _latency(outcomes),
        "failures": [dataclasses.asdict(o) for o in outcomes if o.outcome == "failed"][
            :_MAX_FAILURES_LISTED
        ],
        "after": {
            "metrics": _load_gauges(metrics),
            "snapshot": dataclasses.asdict(snapshot),
            "kv_invariants": invariants,
        },
        "rss_mib": _rss_figures(rss, config.num_requests),
    }
    report["problems"] = _problems(report, config)
    report["passed"] = not report["problems"]
    return report


async def _drive(
    url: str, config: SoakConfig, headers: dict[str, str], progress: _Progress
) -> list[RequestOutcome]:
    outcomes: list[RequestOutcome] = []
    indices = iter(range(config.num_requests))
    limits = httpx.Limits(
        max_connections=config.concurrency, max_keepalive_connections=config.concurrency
    )
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)
    ) as client:

        async def worker() -> None:
            for index in indices:
                outcomes.append(await send(client, plan_request(index, config.seed, config.mix)))
                progress.num_done += 1

        async with anyio.create_task_group() as tg:
            for _ in range(config.concurrency):
                tg.start_soon(worker)
    return sorted(outcomes, key=lambda o: o.index)


def _flush_finished_rows(url: str, headers: dict[str, str]) -> None:
    """The runner frees the rows of finished requests at the start of its next step, so
    after the load the rows of the last step's requests are still held. One more request
    runs that step; afterwards only its own row may still be held."""
    response = httpx.post(
        url + "/v1/completions",
        headers=headers,
        timeout=60,
        json={"prompt": "flush", "max_tokens": 1},
    )
    response.raise_for_status()


def _scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = httpx.get(url + "/metrics", timeout=30).text
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def _finish_reason_counts(
    metrics: dict[str, dict[tuple[tuple[str, str], ...], float]],
) -> dict[str, int]:
    counts = metrics.get("vllm:request_success_total", {})
    return {dict(labels)["finished_reason"]: int(value) for labels, value in counts.items()}


def _load_gauges(metrics: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> dict[str, float]:
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    return {name: sum(metrics.get(name, {}).values()) for name in names}


def _by_plan(outcomes: list[RequestOutcome]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter[str]] = {}
    for outcome in outcomes:
        table.setdefault(outcome.plan, Counter())[outcome.outcome] += 1
    return {plan: dict(counts) for plan, counts in table.items()}


def _latency(outcomes: list[RequestOutcome]) -> dict[str, float]:
    done = sorted(o.elapsed_s for o in outcomes if o.outcome == "completed")
    if not done:
        return {}
    return {
        "completed_p50": round(done[len(done) // 2], 3),
        "completed_p99": round(done[min(len(done) - 1, int(len(done) * 0.99))], 3),
        "completed_max": round(done[-1], 3),
    }


def _rss_figures(rss: RssSampler, num_requests: int) -> dict[str, Any]:
    """RSS in MiB: at points of progress, medians over the middle and the last fifth of the
    run (their difference is the growth judged), and a coarse time series."""

    def mib(num_bytes: float) -> float:
        return round(num_bytes / _MIB, 1)

    def done(fraction: float) -> int:
        return int(num_requests * fraction)

    middle = rss.window_median(done(0.4), done(0.6))
    end = rss.window_median(done(0.8), done(1.0))
    step = max(1, len(rss.samples) // 100)
    return {
        "at_progress": {
            f"{int(p * 100)}%": mib(rss.at_progress(done(p))) for p in (0.0, 0.25, 0.5, 0.75, 1.0)
        },
        "median_40_60%": mib(middle),
        "median_80_100%": mib(end),
        "growth_second_half": mib(end - middle),
        "peak": mib(max(s.rss_bytes for s in rss.samples)),
        "num_samples": len(rss.samples),
        "series_elapsed_s_mib_done": [
            (round(s.elapsed_s, 1), mib(s.rss_bytes), s.num_done) for s in rss.samples[::step]
        ],
    }


def _problems(report: dict[str, Any], config: SoakConfig) -> list[str]:
    problems = []
    outcomes = report["outcomes"]
    if outcomes.get("failed"):
        problems.append(f"{outcomes['failed']} requests failed (see failures)")
    if report["num_5xx"]:
        problems.append(f"{report['num_5xx']} answers were 5xx")
    if report["server_finish_reasons"].get("error"):
        problems.append(f"the engine failed {report['server_finish_reasons']['error']} requests")
    gauges = report["after"]["metrics"]
    if any(gauges.values()):
        problems.append(f"/metrics after the run: {gauges}")
    snap = report["after"]["snapshot"]
    if (snap["num_running"], snap["num_waiting"], snap["num_unfinished_admitted"]) != (0, 0, 0):
        problems.append(f"the engine is not idle after the run: {snap}")
    if snap["num_free_kv_blocks"] != snap["num_total_kv_blocks"]:
        problems.append(
            f"KV blocks leaked: {snap['num_free_kv_blocks']} of {snap['num_total_kv_blocks']} free"
        )
    # After the flush request only that request's own row may still be held.
    if snap["num_free_rows"] is not None and snap["num_free_rows"] < snap["num_rows"] - 1:
        problems.append(f"runner rows leaked: {snap['num_free_rows']} of {snap['num_rows']} free")
    if report["after"]["kv_invariants"] != "ok":
        problems.append(f"KV cache invariants {report['after']['kv_invariants']}")
    growth = report["rss_mib"]["growth_second_half"]
    if growth > config.max_rss_growth_mib:
        problems.append(
            f"RSS grew {growth} MiB from the middle to the end of the run (median "
            f"RSS of 40-60% vs 80-100% of the requests; bound "
            f"{config.max_rss_growth_mib} MiB)"
        )
    return problems


@contextmanager
def _engine_threads(threads: int) -> Iterator[None]:
    """The server's engine core is a child process: its torch threads follow OMP_NUM_THREADS
    as it starts."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def parse_args(argv: list[str] | None = None) -> Any:
    p = recording.parser("soak", __doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens is drawn from [1, N]")
    p.add_argument(
        "--disconnect-within",
        type=float,
        default=30.0,
        help="disconnecting clients hang up at a moment drawn from [0, S] seconds "
        "(default 30: about the median latency at concurrency 128 on 2 cores)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="the server's running batch")
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads of the server's engine core"
    )
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from actors.protocol.config import EngineConfig
    from app.server_state import ServeSettings
    from benchmarks.soak_server import InProcessServer
    from telemetry.logging import configure_logging

    engine = EngineConfig(
        model="default",
        device="cpu",
        max_model_len=2048,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=2048,
    )
    config = SoakConfig(
        num_requests=args.requests,
        concurrency=args.concurrency,
        seed=args.seed,
        mix=SoakMix(max_tokens=args.max_tokens, disconnect_within_s=args.disconnect_within),
        max_rss_growth_mib=args.max_rss_growth_mib,
    )
    run = recording.Run(
        "soak",
        args,
        "soak",
        {
            **dataclasses.asdict(config),
            "engine": dataclasses.asdict(engine),
            "torch_threads": args.threads,
        },
        argv,
    )
    configure_logging(json=True, level="warning")
    with _engine_threads(args.threads):
        server = InProcessServer(ServeSettings(engine=engine, port=0))
    with server:
        report = run_soak(server, config)
    rss = {k: v for k, v in report["rss_mib"].items() if k != "series_elapsed_s_mib_done"}
    figures = {
        "passed": report["passed"],
        "requests_per_s": report["requests_per_s"],
        **{f"outcomes_{k}": v for k, v in sorted(report["outcomes"].items())},
        "num_5xx": report["num_5xx"],
        "rss_growth_second_half_mib": rss["growth_second_half"],
        "rss_peak_mib": rss["peak"],
    }
    run.finish(figures, report)
    print(
        json.dumps(
            {
                **{
                    k: report[k]
                    for k in (
                        "passed",
                        "problems",
                        "elapsed_s",
                        "outcomes",
                        "client_aborts",
                        "num_5xx",
                    )
                },
                "rss_mib": rss,
            },
            indent=2,
        )
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
