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

# The docstring above is --help's text. Here: the command line, the levels and their report;
# the run's settings are in serve_config, the server in server_process, the load in
# serve_clients (client processes) and stream_client (one timed request).

from __future__ import annotations

import math
import sys
from dataclasses import asdict, replace
from typing import Any

import anyio

from benchmarks import recording
from benchmarks.serve_clients import Share, even_share, in_processes, run_client
from benchmarks.serve_config import ServeConfig, config_from_args
from benchmarks.serve_metrics import summarize
from benchmarks.server_args import (
    add_identity_options,
    add_target_options,
    add_timeout_option,
    server_label,
)
from benchmarks.server_process import (
    SERVER_READY_TIMEOUT_S,
    model_and_version,
    scrape_metrics,
    tandem_server,
)
from benchmarks.workloads import (
    DEFAULT_TOKEN_ID_RANGE,
    ENDPOINT_PATHS,
    prompts_digest,
    serve_prompts,
)

WARMUP_SEED_OFFSET = 1_000_003
"""Warmup prompts come from another seed, so they never prefill-cache the measured ones."""


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("serve", __doc__)
    add_target_options(
        p,
        base_url_help="a running server's root, without /v1 (default %(default)s)",
        server_help="start `tandem serve ARGS` on a free port for this run",
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
    add_identity_options(p)
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
    add_timeout_option(p, default_s=3600.0)
    args = p.parse_args(argv)
    try:
        args.config = config_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config: ServeConfig = args.config
    workload = {
        **asdict(config.workload),
        "concurrencies": list(config.concurrencies),
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "warmup_per_level": config.num_warmups,
        "clients": config.clients,
        "server": server_label(args.server, config.base_url),
    }
    run = recording.Run("serve", args, "serve", workload, argv)
    with tandem_server(args.server) as base_url:
        if base_url is not None:
            config = replace(config, base_url=base_url, ready_timeout_s=SERVER_READY_TIMEOUT_S)
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
    model, version = anyio.run(model_and_version, config)
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
        Share(
            index,
            prompts[index :: config.clients],
            warm[index :: config.clients],
            even_share(concurrency, config.clients, index),
        )
        for index in range(config.clients)
    ]
    load_before = recording.load_average()
    if config.clients == 1:
        outcomes = [anyio.run(run_client, config, model, shares[0], None)]
    else:
        outcomes = in_processes(config, model, shares)
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


if __name__ == "__main__":
    sys.exit(main())
