"""`tandem serve`'s checks of its flags, before anything starts."""

from __future__ import annotations

import argparse


def check_serve_args(args: argparse.Namespace) -> None:
    """Raise UserFacingError (one line, exit 2) for flags out of range or combinations
    that do not work (yet), before anything starts."""
    from app.cli_errors import UserFacingError
    from app.engine_watchdog import MIN_STALL_TIMEOUT_S
    from app.heartbeat_pipe import MIN_API_SERVER_STALL_TIMEOUT_S

    checks = [
        (0 <= args.port <= 65535, f"--port must be in [0, 65535], got {args.port}"),
        (args.max_queued_requests >= 0, "--max-queued-requests must be >= 0"),
        (
            args.max_queued_prompt_tokens is None or args.max_queued_prompt_tokens >= 1,
            "--max-queued-prompt-tokens must be at least 1",
        ),
        (args.max_request_body_bytes >= 1024, "--max-request-body-bytes must be >= 1024"),
        (args.keep_alive_interval >= 0, "--keep-alive-interval must be >= 0"),
        (args.shutdown_timeout >= 0, "--shutdown-timeout must be >= 0"),
        (args.keep_alive_timeout > 0, "--keep-alive-timeout must be > 0"),
        (args.request_body_timeout > 0, "--request-body-timeout must be > 0"),
        (args.send_timeout >= 0, "--send-timeout must be >= 0"),
        (
            args.max_consecutive_failed_steps >= 1,
            "--max-consecutive-failed-steps must be at least 1",
        ),
        (
            args.engine_stall_timeout == 0 or args.engine_stall_timeout >= MIN_STALL_TIMEOUT_S,
            f"--engine-stall-timeout must be 0 or at least {MIN_STALL_TIMEOUT_S:g}",
        ),
        (args.max_n >= 1, "--max-n must be at least 1"),
        (args.grammar_compile_timeout > 0, "--grammar-compile-timeout must be > 0"),
        (1 <= args.api_server_count <= 64, "--api-server-count must be in [1, 64]"),
        (1 <= args.data_parallel_size <= 64, "--data-parallel-size must be in [1, 64]"),
        (
            args.distributed_executor_backend == "mp",
            "--distributed-executor-backend external_launcher is for offline programs "
            "started by torchrun (`tandem generate`, the Python LLM); `tandem serve` "
            "starts its own ranks",
        ),
        (
            args.data_parallel_size == 1
            or args.tensor_parallel_size == args.pipeline_parallel_size == 1,
            "--data-parallel-size above 1 with --tensor-parallel-size or "
            "--pipeline-parallel-size above 1 is not "
            "supported yet (each core would need its own GPUs for its ranks)",
        ),
        (
            args.data_parallel_size == 1 or ":" not in str(args.device),
            f"--device {args.device} names one GPU, but --data-parallel-size "
            f"{args.data_parallel_size} runs core i on cuda:i; pass --device cuda (or auto) "
            "and choose the GPUs with CUDA_VISIBLE_DEVICES",
        ),
        (
            args.api_server_stall_timeout == 0
            or args.api_server_stall_timeout >= MIN_API_SERVER_STALL_TIMEOUT_S,
            f"--api-server-stall-timeout must be 0 or at least {MIN_API_SERVER_STALL_TIMEOUT_S:g}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise UserFacingError(message)
    problem = _reasoning_parser_problem(args.reasoning_parser, args.model)
    if problem is not None:
        raise UserFacingError(problem)


def _reasoning_parser_problem(parser: str, model: str) -> str | None:
    """Why --reasoning-parser cannot read this model's chat: harmony (gpt-oss) has its own
    parser, the others read `<think>` blocks."""
    from app.harmony.model import is_gpt_oss
    from app.reasoning.parsers import HARMONY_PARSER

    if parser == "none":
        return None
    harmony = is_gpt_oss(model)
    if parser == HARMONY_PARSER and not harmony:
        return (
            f"--reasoning-parser {parser} reads gpt-oss's harmony format, and --model "
            f"{model} is not a gpt-oss model; use qwen3, deepseek_r1 or none"
        )
    if parser != HARMONY_PARSER and harmony:
        return (
            f"--reasoning-parser {parser} reads <think> blocks, and --model {model} is a "
            f"gpt-oss model, whose reasoning is read from harmony anyway; use "
            f"{HARMONY_PARSER} or none"
        )
    return None
