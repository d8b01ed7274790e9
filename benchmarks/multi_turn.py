"""Multi-turn chat: what the prefix cache saves when turn k+1 of a conversation repeats turn
k's prompt and answer (issue 29: decoded blocks are published, so turn k+1 can hit the
prefix up to the end of turn k's answer).

    # GPU: dummy qwen3-0.6b with the real tokenizer, 128 conversations x 8 turns
    python -m benchmarks.multi_turn --result multi_turn_qwen3 --server "--model \\
        dummy:qwen3-0.6b --tokenizer .tok/qwen3 --max-num-seqs 256 \\
        --gpu-memory-utilization 0.85" --tokenizer .tok/qwen3
    # the embedded model on the CPU (a few minutes on 2 cores)
    python -m benchmarks.multi_turn --not-a-result --server "--device cpu --dtype float32 \\
        --max-num-seqs 16" --conversations 4 --turns 3 --system-len 200 --user-len 30 \\
        --answer-len 16 --concurrency 2
    # the host tier's target: the device pool too small to keep conversations between
    # turns (--num-kv-blocks), with --kv-offload-cpu-gb 16 against without; the tiers' hits
    # are tandem:kv_offload_hits_total in the server counters. --think-time lets other
    # conversations' turns run between a conversation's turns (as users pause to read),
    # which is when a small pool evicts them
    # random weights whose answers do not survive detokenizing and tokenizing again (the 8B
    # dummies): the turns as token ids, each answer's exact ids sent back
    python -m benchmarks.multi_turn --result multi_turn_qwen3_8b --server "--model \
        dummy:qwen3-8b --tokenizer .tok/qwen3" --tokenizer .tok/qwen3 --token-ids
    # with decoded-block reuse (NEW) against without (BASE): a run on each tree, then
    python -m benchmarks.multi_turn --compare BASE.json NEW.json

The conversations share one system prompt (`--system-len` tokens) and send `--turns` user
turns (`--user-len` tokens) in sequence: turn k+1 goes out when turn k's answer has come,
with that answer's text as the assistant message. Answers are exactly `--answer-len` tokens
(max_tokens, ignore_eos). `--concurrency` conversations are in flight (each holds its slot
for all its turns), over `--clients` processes. Stream usage gives prompt and cached tokens.

Texts are seeded random common words, sized exactly in tokens by `--tokenizer` (the server's
tokenizer.json or directory): the robust way, for results. Else one POST /tokenize gives the
server's tokens per word (or 1 if it fails) and sizes are near. Each answer's text is
tokenized again next turn; where that does not give the generated ids back (likely with
dummy weights' random tokens) the hit ends: `prior_context_tokens_mean` (previous turn's
prompt + answer) is what a full hit would be. `--token-ids` sends each turn to
/v1/completions as one token-id prompt (system, then user turns and answers, no chat
template), the answers' ids taken from the stream (`return_token_ids`): hits then reach the
end of the last answer whatever its text.

Per turn: requests, TTFT p50/p90, prompt, cached, computed (prompt - cached) tokens; overall:
output tok/s, prefill tokens computed, hit rate, the server's counters' deltas (/metrics).
"""

# The docstring above is --help's text. Here: the command line and the run; the conversations
# and their requests are in multi_turn_chat, the figures and the table in multi_turn_figures.

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

from benchmarks import recording
from benchmarks.multi_turn_chat import Settings, build_conversations, run_share, tokens_per_word
from benchmarks.multi_turn_figures import (
    compare,
    counter_deltas,
    describe,
    headline,
    overall,
    per_turn,
    read_counters,
)
from benchmarks.serve_clients import Share, even_share, in_processes
from benchmarks.serve_config import ServeConfig
from benchmarks.server_args import (
    add_identity_options,
    add_target_options,
    add_timeout_option,
    checked_base_url,
    require_at_least,
    server_label,
)
from benchmarks.server_process import SERVER_READY_TIMEOUT_S, model_and_version, tandem_server
from benchmarks.workloads import ServeWorkload

COUNTS = tuple("conversations turns system_len user_len answer_len concurrency clients".split())
WORKLOAD = (*COUNTS, "temperature", "seed", "tokenizer", "token_ids", "think_time_s")


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("multi_turn", __doc__)
    target = add_target_options(
        p,
        base_url_help="a running server",
        server_help="start `tandem serve ARGS` for the run",
    )
    compare_help = "print per-turn ratios NEW/BASE of two result (or --output) files; runs nothing"
    target.add_argument("--compare", nargs=2, type=Path, metavar=("BASE", "NEW"), help=compare_help)
    p.add_argument("--tokenizer", help="the server's tokenizer, to size texts exactly in tokens")
    token_ids_help = (
        "send turns to /v1/completions as token ids, each answer's exact ids (return_token_ids) "
        "carried into the next turn, without a chat template: reuse measured whatever the "
        "answers' text would tokenize to (needs --tokenizer)"
    )
    p.add_argument("--token-ids", action="store_true", help=token_ids_help)
    add_identity_options(p)
    p.add_argument("--conversations", type=int, default=128)
    p.add_argument("--turns", type=int, default=8, help="user turns per conversation")
    p.add_argument("--system-len", type=int, default=1000, help="shared system prompt tokens")
    p.add_argument("--user-len", type=int, default=200, help="tokens per user turn")
    p.add_argument("--answer-len", type=int, default=300, help="tokens per answer (exact)")
    p.add_argument("--concurrency", type=int, default=64, help="conversations in flight")
    p.add_argument("--clients", type=int, default=1, help="client processes (default 1)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the random texts")
    think_help = (
        "seconds a conversation pauses before each later turn, its slot given to another "
        "conversation meanwhile (default 0: a conversation keeps its slot for all its turns). "
        "With more conversations than --concurrency, other conversations' turns then run "
        "between a conversation's turns, as a chat service's users do: what the KV tiers are for"
    )
    p.add_argument("--think-time", dest="think_time_s", type=float, default=0.0, help=think_help)
    add_timeout_option(p, default_s=3600.0)
    args = p.parse_args(argv)
    if args.compare is None:
        try:
            args.settings = settings_from_args(args)
        except ValueError as exc:
            p.error(str(exc))
    return args


def settings_from_args(args: Any) -> Settings:
    """The run's settings; ValueError names the flag that is wrong."""
    for name in COUNTS:
        least = 0 if name == "system_len" else 1
        require_at_least(f"--{name.replace('_', '-')}", getattr(args, name), least)
    if args.think_time_s < 0:
        raise ValueError("--think-time must be >= 0")
    if args.token_ids and not args.tokenizer:
        raise ValueError("--token-ids needs --tokenizer")
    if args.clients > min(args.concurrency, args.conversations):
        raise ValueError("--clients is more than --concurrency or --conversations")
    base_url = checked_base_url(args.base_url)
    unused = ServeWorkload("chat", 1, 1, args.answer_len, True, args.temperature, args.seed)
    target = ServeConfig(base_url, unused, (args.concurrency,), model=args.model)
    ready_s = SERVER_READY_TIMEOUT_S if args.server else 60.0
    target = replace(target, api_key=args.api_key, timeout_s=args.timeout, ready_timeout_s=ready_s)
    return Settings(target, **{name: getattr(args, name) for name in WORKLOAD})


def run(settings: Settings) -> dict[str, Any]:
    """Measure one server; returns the details of the record."""
    model, version = anyio.run(model_and_version, settings.target)
    from app.tokenizer_loader import load_tokenizer

    tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
    per_word = 1.0 if tokenizer is not None else anyio.run(tokens_per_word, settings, model)
    conversations = build_conversations(settings, per_word, tokenizer)
    n, url, key = settings.clients, settings.target.base_url, settings.target.api_key
    split = [even_share(settings.concurrency, n, i) for i in range(n)]
    shares = [Share(i, conversations[i::n], [], split[i]) for i in range(n)]
    before = read_counters(url, key)
    if n == 1:
        outcomes: list[Any] = [anyio.run(run_share, settings, model, shares[0], None)]
    else:
        outcomes = in_processes(settings, model, shares, run_share)  # type: ignore[arg-type]
    after = read_counters(url, key)
    records = [r for o in outcomes for r in o[0]]
    duration_s = max(o[2] for o in outcomes) - min(o[1] for o in outcomes)
    return {
        "base_url": url,
        "model": model,
        "server_version": version,
        "sized_by": "tokenizer" if tokenizer is not None else f"{per_word:.3f} tokens/word",
        "turns": per_turn(records, settings.turns),
        "overall": overall(records, duration_s, settings.answer_len),
        "server_counters": counter_deltas(before, after),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare is not None:
        base, new = (json.loads(path.read_text()) for path in args.compare)
        print("\n".join(compare(base, new)))
        return 0
    settings: Settings = args.settings
    workload = {name: getattr(settings, name) for name in WORKLOAD}
    workload["server"] = server_label(args.server, settings.target.base_url)
    record = recording.Run("multi_turn", args, "multi_turn", workload, argv)
    with tandem_server(args.server) as base_url:
        if base_url is not None:
            settings = replace(settings, target=replace(settings.target, base_url=base_url))
        details = run(settings)
    record.finish(headline(details), details)
    print("\n".join(describe(details)), flush=True)
    return 0 if details["overall"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
