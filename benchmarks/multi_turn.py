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
    # are tandem:kv_offload_hits_total in the server counters
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
prompt + answer) is what a full hit would be.

Per turn: requests, TTFT p50/p90, prompt, cached, computed (prompt - cached) tokens; overall:
output tok/s, prefill tokens computed, hit rate, the server's counters' deltas (/metrics).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchmarks import recording, serve
from benchmarks.serve_metrics import distribution_ms
from benchmarks.workloads import ServeWorkload, text_prompts

COUNTERS = ("vllm:prefix_cache_", "vllm:prompt_tokens_", "tandem:kv_offload_hits")
PHASES = ("time_to_first_token", "request_queue_time", "request_prefill_time")
"""The server's own latency histograms (seconds), whose means over the run split the
client's TTFT into waiting, prefill and the rest (the front end and the client itself)."""
"""/metrics counters read before and after the run, with every one about preemption."""
COUNTS = tuple("conversations turns system_len user_len answer_len concurrency clients".split())
WORKLOAD = (*COUNTS, "temperature", "seed", "tokenizer")
RATIO_KEYS = ("ttft_p50_ms", "computed_prefill_tokens_mean")
STREAM = {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
"""Every request's (with the model, max_tokens and temperature)."""


@dataclass(frozen=True, slots=True)
class Settings:
    target: serve.ServeConfig  # base_url, model, api key, timeouts (its workload is unused)
    conversations: int
    turns: int
    system_len: int
    user_len: int
    answer_len: int
    concurrency: int
    clients: int
    temperature: float
    seed: int
    tokenizer: str | None


@dataclass(frozen=True, slots=True)
class TurnRecord:
    conversation: int
    turn: int  # from 1
    success: bool
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    system: str
    users: tuple[str, ...]


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("multi_turn", __doc__)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server")
    target.add_argument("--server", metavar="ARGS", help="start `tandem serve ARGS` for the run")
    compare = "print per-turn ratios NEW/BASE of two result (or --output) files; runs nothing"
    target.add_argument("--compare", nargs=2, type=Path, metavar=("BASE", "NEW"), help=compare)
    p.add_argument("--tokenizer", help="the server's tokenizer, to size texts exactly in tokens")
    p.add_argument("--model", help="model name to send (default: the first in /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--conversations", type=int, default=128)
    p.add_argument("--turns", type=int, default=8, help="user turns per conversation")
    p.add_argument("--system-len", type=int, default=1000, help="shared system prompt tokens")
    p.add_argument("--user-len", type=int, default=200, help="tokens per user turn")
    p.add_argument("--answer-len", type=int, default=300, help="tokens per answer (exact)")
    p.add_argument("--concurrency", type=int, default=64, help="conversations in flight")
    p.add_argument("--clients", type=int, default=1, help="client processes (default 1)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the random texts")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
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
        least, value = (0 if name == "system_len" else 1), getattr(args, name)
        if value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if args.clients > min(args.concurrency, args.conversations):
        raise ValueError("--clients is more than --concurrency or --conversations")
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    unused = ServeWorkload("chat", 1, 1, args.answer_len, True, args.temperature, args.seed)
    target = serve.ServeConfig(base_url, unused, (args.concurrency,), model=args.model)
    ready_s = serve.SERVER_READY_TIMEOUT_S if args.server else 60.0
    target = replace(target, api_key=args.api_key, timeout_s=args.timeout, ready_timeout_s=ready_s)
    return Settings(target, **{name: getattr(args, name) for name in WORKLOAD})


def build_conversations(settings: Settings, tokens_per_word: float, tokenizer: Any) -> list[Any]:
    """Seeded texts: one system prompt shared by all, `turns` user turns per conversation."""
    n, turns = settings.conversations, settings.turns

    def texts(count: int, length: int, seed: int) -> list[str]:
        if length == 0 or tokenizer is not None:
            return text_prompts(count, length, seed, tokenizer) if length else [""] * count
        return text_prompts(count, max(1, round(length / tokens_per_word)), seed)

    (system,) = texts(1, settings.system_len, settings.seed)
    users = texts(n * turns, settings.user_len, settings.seed + 1)
    return [Conversation(c, system, tuple(users[c * turns : (c + 1) * turns])) for c in range(n)]


def turn_messages(conversation: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The messages of the turn after `answers`: the system prompt, each earlier user turn
    followed by its answer, then the next user turn."""
    messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
    for user, answer in zip(conversation.users, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": conversation.users[len(answers)]}]


async def tokens_per_word(settings: Settings, model: str) -> float:
    """The server's tokens per word of this benchmark's text (1.0 if /tokenize fails)."""
    body = {"prompt": text_prompts(1, 400, 0)[0], "add_special_tokens": False, "model": model}
    headers = serve._auth_headers(settings.target.api_key)
    try:
        async with httpx.AsyncClient(base_url=settings.target.base_url, headers=headers) as client:
            response = await client.post("/tokenize", json=body, timeout=60)
        return float(response.json()["count"]) / 400 if response.status_code == 200 else 1.0
    except (httpx.HTTPError, ValueError, KeyError):
        return 1.0


async def chat_turn(
    client: httpx.AsyncClient, base: dict[str, Any], chat: Conversation, answers: list[str]
) -> tuple[TurnRecord, str]:
    """Send the turn after `answers` (`base`: the rest of the body); its record and text."""
    body = {**base, "messages": turn_messages(chat, answers)}
    pieces: list[str] = []

    def keep_text(event: dict[str, Any]) -> None:
        pieces.extend((c.get("delta") or {}).get("content") or "" for c in event.get("choices", ()))

    r = await serve.stream_request(client, "/v1/chat/completions", body, keep_text)
    tokens = (r.prompt_tokens, r.cached_prompt_tokens, r.output_tokens)
    record = TurnRecord(chat.index, len(answers) + 1, r.success, r.ttft_s, *tokens, r.error)
    return record, "".join(pieces)


async def _run_share(
    settings: Settings, model: str, share: serve._Share, barrier: Any
) -> tuple[list[TurnRecord], float, float]:
    """One client's conversations (`share.prompts`): their records, start and end."""
    limiter, records = anyio.Semaphore(share.concurrency), []
    base = {**STREAM, "model": model, "max_tokens": settings.answer_len}
    base["temperature"] = settings.temperature
    async with httpx.AsyncClient(
        base_url=settings.target.base_url,
        limits=httpx.Limits(max_connections=share.concurrency + 8),
        timeout=httpx.Timeout(settings.target.timeout_s, connect=30.0),
        headers=serve._auth_headers(settings.target.api_key),
    ) as client:

        async def converse(chat: Conversation) -> None:
            async with limiter:
                answers: list[str] = []
                while len(answers) < settings.turns:
                    record, answer = await chat_turn(client, base, chat, answers)
                    records.append(record)
                    if not record.success:
                        return  # no answer to build the next turn on
                    answers.append(answer)

        if barrier is not None:
            await anyio.to_thread.run_sync(barrier.wait)
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for chat in share.prompts:
                tg.start_soon(converse, chat)
    return records, started, time.monotonic()


def per_turn(records: list[TurnRecord], turns: int) -> list[dict[str, Any]]:
    """Each turn's figures over the conversations whose turn succeeded."""
    by_key = {(r.conversation, r.turn): r for r in records if r.success}
    rows = []
    for turn in range(1, turns + 1):
        done = [r for r in records if r.turn == turn and r.success]
        failed = sum(1 for r in records if r.turn == turn and not r.success)
        prior = [by_key.get((r.conversation, turn - 1)) for r in done]
        context = _mean([p.prompt_tokens + p.output_tokens for p in prior if p is not None])
        rows.append({"turn": turn, "requests": len(done), "failed": failed, **_figures(done)})
        rows[-1]["prior_context_tokens_mean"] = context
    return rows


def _figures(done: list[TurnRecord]) -> dict[str, Any]:
    ttft = distribution_ms([r.ttft_s for r in done], (50.0, 90.0))
    return {
        "ttft_p50_ms": ttft["p50_ms"],
        "ttft_p90_ms": ttft["p90_ms"],
        "prompt_tokens_mean": _mean([r.prompt_tokens for r in done]),
        "cached_tokens_mean": _mean([r.cached_tokens for r in done]),
        "computed_prefill_tokens_mean": _mean([r.prompt_tokens - r.cached_tokens for r in done]),
    }


def overall(records: list[TurnRecord], duration_s: float, answer_len: int) -> dict[str, Any]:
    done = [r for r in records if r.success]
    prompt, cached = sum(r.prompt_tokens for r in done), sum(r.cached_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    later = [r for r in done if r.turn > 1]
    return {
        "requests": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "output_tokens": output,
        "output_tok_s": output / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens_computed": prompt - cached,
        "hit_rate": cached / prompt if prompt else None,
        "answer_len_mismatches": sum(1 for r in done if r.output_tokens != answer_len),
        "turns_2_on": {"requests": len(later), **_figures(later)},
        "errors": sorted({r.error for r in records if not r.success})[:10],
    }


def read_counters(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's COUNTERS and preemption counters (vllm: and tandem:), summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", headers=serve._auth_headers(api_key), timeout=30).text
    found: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            ours = s.name.startswith(COUNTERS) or "preempt" in s.name
            if ours and s.name.startswith(("vllm:", "tandem:")) and s.name.endswith("_total"):
                found[s.name] += s.value
            if s.name.removeprefix("vllm:").removesuffix("_seconds_sum") in PHASES:
                found[s.name] += s.value
            if s.name.removeprefix("vllm:").removesuffix("_seconds_count") in PHASES:
                found[s.name] += s.value
    return dict(found)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    deltas: dict[str, Any] = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}
    q, h = (deltas.get(f"vllm:prefix_cache_{k}_total") for k in ("queries", "hits"))
    means_ms = {}
    for phase in PHASES:
        total_s, count = (deltas.pop(f"vllm:{phase}_seconds_{k}", 0.0) for k in ("sum", "count"))
        means_ms[f"server_{phase}_mean_ms"] = 1000 * total_s / count if count else None
    return deltas | {"server_hit_rate": h / q if q and h is not None else None} | means_ms


def headline(details: dict[str, Any]) -> dict[str, Any]:
    """The figures benchmarks.report compares."""
    o, later = details["overall"], details["overall"]["turns_2_on"]
    figures = {k: o[k] for k in ("output_tok_s", "prefill_tokens_computed", "hit_rate", "failed")}
    figures["turn1_ttft_p50_ms"] = details["turns"][0]["ttft_p50_ms"]
    figures["turns_2_on_ttft_p50_ms"] = later["ttft_p50_ms"]
    figures["turns_2_on_computed_prefill_mean"] = later["computed_prefill_tokens_mean"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


def compare(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """NEW/BASE per turn and over turns 2 on (pooled) of TTFT p50 and computed prefill
    tokens; the issue asks for both at most 0.5 on turns 2 on. `base` and `new` are result
    files (their current entry) or --output records."""
    b, n = (r.get("current", r)["details"] for r in (base, new))
    rows = [(str(x["turn"]), x, y) for x, y in zip(b["turns"], n["turns"], strict=False)]
    rows.append(("2-on", b["overall"]["turns_2_on"], n["overall"]["turns_2_on"]))
    lines = ["turn  TTFT p50 ms: base -> new (new/base)   computed prefill: base -> new (new/base)"]
    for name, x, y in rows:
        cells = (f"{_num(x.get(k))} -> {_num(y.get(k))} ({ratio(x, y, k):.3f})" for k in RATIO_KEYS)
        lines.append(f"{name:>4}  " + "   ".join(cells))
    halved = all(ratio(rows[-1][1], rows[-1][2], k) <= 0.5 for k in RATIO_KEYS)
    return [*lines, f"turns 2 on: TTFT p50 and computed prefill halved: {halved}"]


def ratio(base: dict[str, Any], new: dict[str, Any], key: str) -> float:
    b, n = base.get(key), new.get(key)
    return math.nan if b is None or n is None or b == 0 else n / b


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def describe(details: dict[str, Any]) -> list[str]:
    keys = "ttft_p50_ms ttft_p90_ms prompt_tokens_mean cached_tokens_mean".split()
    keys += ["computed_prefill_tokens_mean", "prior_context_tokens_mean"]
    lines = ["turn  reqs  fail  TTFT p50 ms  TTFT p90 ms   prompt   cached  computed  prior ctx"]
    for t in details["turns"]:
        figures = "".join(f"{_num(t[k]):>{w}}" for k, w in zip(keys, (13, 13, 9, 9, 10, 11)))
        lines.append(f"{t['turn']:>4}  {t['requests']:>4}  {t['failed']:>4}{figures}")
    o = details["overall"]
    hit = "-" if o["hit_rate"] is None else f"{o['hit_rate']:.3f}"
    lines.append(
        f"overall: {o['requests']} ok, {o['failed']} failed, {o['output_tok_s']:.1f} output "
        f"tok/s, {o['prefill_tokens_computed']:,} prefill tokens computed of "
        f"{o['prompt_tokens']:,}, hit rate {hit}, {o['duration_s']:.1f} s"
    )
    lines.append(f"server counters over the run: {json.dumps(details['server_counters'])}")
    return lines + [f"first error: {e}" for e in o["errors"][:1]]


def run(settings: Settings) -> dict[str, Any]:
    """Measure one server; returns the details of the record."""
    model, version = anyio.run(serve._model_and_version, settings.target)
    from app.tokenizer_loader import load_tokenizer

    tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
    per_word = 1.0 if tokenizer is not None else anyio.run(tokens_per_word, settings, model)
    conversations = build_conversations(settings, per_word, tokenizer)
    n, url, key = settings.clients, settings.target.base_url, settings.target.api_key
    split = [serve._split(settings.concurrency, n, i) for i in range(n)]
    shares = [serve._Share(i, conversations[i::n], [], split[i]) for i in range(n)]
    before = read_counters(url, key)
    if n == 1:
        outcomes: list[Any] = [anyio.run(_run_share, settings, model, shares[0], None)]
    else:
        outcomes = serve._in_processes(settings, model, shares, _run_share)  # type: ignore[arg-type]
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
    workload["server"] = f"tandem serve {args.server}" if args.server else settings.target.base_url
    record = recording.Run("multi_turn", args, "multi_turn", workload, argv)
    with serve._server(args.server) as base_url:
        if base_url is not None:
            settings = replace(settings, target=replace(settings.target, base_url=base_url))
        details = run(settings)
    record.finish(headline(details), details)
    print("\n".join(describe(details)), flush=True)
    return 0 if details["overall"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
