"""`tandem bench serve`: measure a running server under load (vLLM's serve metrics).

    tandem serve --device cpu --max-num-seqs 64 &
    tandem bench serve --base-url http://127.0.0.1:8000 --endpoint completions \\
        --num-prompts 64 --input-len 128 --output-len 64 --concurrency 1,16,64 \\
        --ignore-eos --warmup 4 --output benchmarks/results/serve.json
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from benchmarks.serve_workload import DEFAULT_TOKEN_ID_RANGE


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "serve", help="online latency/throughput of a running server (TTFT, TPOT, ITL, E2EL)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, without /v1 (default http://127.0.0.1:8000)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions sends random token-id prompts of exactly --input-len "
                        "tokens; chat sends --input-len random words (default completions)")
    p.add_argument("--model", help="model name to send (default: the first in /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=64, help="measured requests per level")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--concurrency", default="1",
                   help="comma-separated most-in-flight counts, one level each (default 1)")
    p.add_argument("--request-rate", default="inf",
                   help="requests/s on a Poisson clock, or inf: all sent at once (default)")
    p.add_argument("--warmup", type=int, default=0,
                   help="unmeasured requests before each level (default 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --output-len tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--token-id-range", default="{}:{}".format(*DEFAULT_TOKEN_ID_RANGE),
                   help="LOW:HIGH range of the random prompt token ids (default %(default)s)")
    p.add_argument("--tokenizer",
                   help="chat: a tokenizer.json or Hugging Face tokenizer directory (the "
                        "server's) to make each message exactly --input-len tokens")
    p.add_argument("--response-format", type=_json_object, metavar="JSON",
                   help="response_format of every request, e.g. '{\"type\": \"json_object\"}' "
                        "(or @FILE holding it)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--output", type=Path, help="JSON result path (printed summary only without)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from benchmarks.run_info import command_line
    from benchmarks.serve_client import ServerUnavailableError, run_serve_benchmark
    from app.cli_errors import UserFacingError

    config = config_from_args(args)
    # One line per request would drown the summary.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        record = run_serve_benchmark(config, command_line(), args.output)
    except ServerUnavailableError as exc:
        raise UserFacingError(str(exc)) from None
    for level in record["levels"]:
        print(describe_level(level), flush=True)
    if args.output is not None:
        print(f"wrote {args.output}")
    return 0


def config_from_args(args: argparse.Namespace) -> Any:
    from benchmarks.serve_client import ServeBenchConfig
    from benchmarks.serve_workload import Workload
    from app.cli_errors import UserFacingError

    concurrencies = _positive_ints(args.concurrency, "--concurrency")
    rate = _request_rate(args.request_rate)
    token_range = _token_range(args.token_id_range)
    for name, value, least in (("--num-prompts", args.num_prompts, 1),
                               ("--input-len", args.input_len, 1),
                               ("--output-len", args.output_len, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            raise UserFacingError(f"{name} must be at least {least}, got {value}")
    if args.timeout <= 0:
        raise UserFacingError(f"--timeout must be positive, got {args.timeout}")
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if not base_url.startswith(("http://", "https://")):
        raise UserFacingError(f"--base-url must start with http:// or https://, got "
                              f"{args.base_url!r}")
    workload = Workload(endpoint=args.endpoint, num_prompts=args.num_prompts,
                        input_len=args.input_len, output_len=args.output_len,
                        ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed,
                        token_id_range=token_range, tokenizer=args.tokenizer,
                        response_format=args.response_format)
    return ServeBenchConfig(base_url=base_url, workload=workload, concurrencies=concurrencies,
                            request_rate=rate, num_warmups=args.warmup, model=args.model,
                            api_key=args.api_key, timeout_s=args.timeout)


def describe_level(level: dict[str, Any]) -> str:
    def ms(metric: str, stat: str) -> str:
        value = level[metric][stat]
        return "-" if value is None else f"{value:.1f}"

    return (f"concurrency {level['concurrency']}: {level['completed']} ok, "
            f"{level['failed']} failed, {level['output_throughput_tok_s']:.1f} output tok/s, "
            f"{level['request_throughput_req_s']:.2f} req/s | ms median/p99: "
            f"TTFT {ms('ttft', 'median_ms')}/{ms('ttft', 'p99_ms')} "
            f"TPOT {ms('tpot', 'median_ms')}/{ms('tpot', 'p99_ms')} "
            f"ITL {ms('itl', 'median_ms')}/{ms('itl', 'p99_ms')} "
            f"E2EL {ms('e2el', 'median_ms')}/{ms('e2el', 'p99_ms')}"
            + (f" | first error: {level['errors'][0]}" if level.get("errors") else ""))


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    from app.cli_errors import UserFacingError

    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise UserFacingError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def _request_rate(text: str) -> float:
    from app.cli_errors import UserFacingError

    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not rate > 0:
        raise UserFacingError(f"--request-rate must be 'inf' or a positive number, got {text!r}")
    return rate


def _token_range(text: str) -> tuple[int, int]:
    from app.cli_errors import UserFacingError

    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        low = high = -1
    if not 0 <= low < high:
        raise UserFacingError(f"--token-id-range must be LOW:HIGH with 0 <= LOW < HIGH, got "
                              f"{text!r}")
    return low, high


def _json_object(text: str) -> dict[str, Any]:
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as f:
            text = f.read()
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
