"""What one run of benchmarks.serve is (ServeConfig: the server, the workload, the load levels,
the client settings) and how its flags become one, with the parsers of serve's own values
(--request-rate, --token-id-range, the JSON of --response-format and --extra-body).
benchmarks.multi_turn and benchmarks.cpu_llamacpp reuse ServeConfig for the server part."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.server_args import checked_base_url, positive_ints, require_at_least
from benchmarks.workloads import ServeWorkload


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


def config_from_args(args: Any) -> ServeConfig:
    """The run's configuration; ValueError names the flag that is wrong."""
    concurrencies = positive_ints(args.concurrency, "--concurrency")
    for name, value, least in (
        ("--num-prompts", args.num_prompts, 1),
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 1),
        ("--warmup", args.warmup, 0),
        ("--clients", args.clients, 1),
    ):
        require_at_least(name, value, least)
    if args.clients > min(concurrencies + (args.num_prompts,)):
        raise ValueError(
            f"--clients {args.clients} is more than the smallest concurrency or "
            "--num-prompts: every client needs a request in flight"
        )
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    base_url = checked_base_url(args.base_url)
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
