"""Command-line options and checks shared by the benchmarks that drive a server over HTTP
(benchmarks.serve, benchmarks.multi_turn, benchmarks.cpu_llamacpp): which server (a running
one or one started for the run), the model and key to send, the per-request timeout, and the
checks that turn those flags into a run's settings, each naming the flag that is wrong."""

from __future__ import annotations

import argparse

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def add_target_options(
    p: argparse.ArgumentParser, *, base_url_help: str, server_help: str
) -> argparse._MutuallyExclusiveGroup:
    """--base-url or --server, never both. The help texts are each benchmark's own (its
    --help says what it does with the server); the group is returned so that a benchmark can
    add another way to run that excludes both (multi_turn's --compare)."""
    target = p.add_mutually_exclusive_group()
    target.add_argument("--base-url", default=DEFAULT_BASE_URL, help=base_url_help)
    target.add_argument("--server", metavar="ARGS", help=server_help)
    return target


def add_identity_options(p: argparse.ArgumentParser) -> None:
    """--model and --api-key: what every request names and how it authenticates."""
    p.add_argument("--model", help="model name to send (default: the first in /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")


def add_timeout_option(p: argparse.ArgumentParser, default_s: float) -> None:
    p.add_argument("--timeout", type=float, default=default_s, help="seconds per request")


def checked_base_url(text: str) -> str:
    """The server's root as the clients join paths to it: no trailing / and no /v1, which
    users often copy from an OpenAI client's setting."""
    base_url = text.rstrip("/").removesuffix("/v1")
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {text!r}")
    return base_url


def require_at_least(flag: str, value: int, least: int) -> None:
    if value < least:
        raise ValueError(f"{flag} must be at least {least}, got {value}")


def positive_ints(text: str, flag: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (e.g. --concurrency 1,16,64)."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def server_label(server_args: str | None, base_url: str) -> str:
    """How a result's workload names the server it measured."""
    return f"tandem serve {server_args}" if server_args else base_url
