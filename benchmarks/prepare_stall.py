"""How long preparing one long chat request stops the API server's event loop.

    python -m benchmarks.prepare_stall --tokenizer .tok/qwen3

The server prepares a body over 8 KB (validation, chat template, tokenization) in a worker
thread (app/http_input.py), so what holds the GIL there stops the event loop, which writes
every stream's tokens. The request is the last turn of benchmarks.multi_turn's chat: a
system prompt of `--system-len` tokens, `--turns` - 1 earlier turns of `--user-len`-token
questions and `--answer-len`-token answers, and one more question (the run's own seeded
texts). A thread that sleeps 0.2 ms in a loop stands for the event loop; its longest wait
while another thread prepares the request is that request's stall. Two arms, interleaved:
`tokenizer` tokenizes as the server does (app.tokenizer.Tokenizer.encode), `encode_gil`
with the `tokenizers` call that holds the GIL (`encode`, the server's before 443dcfe).
Figures per arm: the median stall and the median time to prepare, over `--repeats`
requests each. The default tokenizer is the embedded model's.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import orjson

from app.prompts import chat_prompt
from app.schemas import ChatCompletionRequest
from app.tokenizer_loader import load_tokenizer
from benchmarks import recording
from benchmarks.multi_turn_chat import Conversation, turn_messages
from benchmarks.workloads import text_prompts

TICK_S = 0.0002
ARMS = ("tokenizer", "encode_gil")


class _EncodeHoldingGil:
    """The server's tokenizer, but tokenizing with `tokenizers`' GIL-holding `encode`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens:  # chat prompts come without (their template writes them)
            return list(self._tokenizer.encode(text, True))
        return list(self._tokenizer.raw.encode(text, add_special_tokens=False).ids)


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("prepare_stall", __doc__)
    p.add_argument("--tokenizer", help="a tokenizer folder or model (default: the embedded)")
    p.add_argument("--turns", type=int, default=8, help="the request is this turn's")
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--user-len", type=int, default=200)
    p.add_argument("--answer-len", type=int, default=300)
    p.add_argument("--repeats", type=int, default=10, help="requests per arm")
    return p.parse_args(argv)


def chat_body(tokenizer: Any, args: Any) -> bytes:
    """The last turn's request body, streamed as benchmarks.multi_turn sends it."""
    (system,) = text_prompts(1, args.system_len, 0, tokenizer)
    users = text_prompts(args.turns, args.user_len, 1, tokenizer)
    answers = text_prompts(args.turns - 1, args.answer_len, 2, tokenizer)
    messages = turn_messages(Conversation(0, system, tuple(users)), answers)
    return orjson.dumps({"model": "m", "messages": messages, "stream": True, "max_tokens": 300})


def stall(prepare: Callable[[], Any]) -> tuple[float, float]:
    """(the ticking thread's longest wait, the time to prepare) in ms, for one request
    prepared in a thread of its own, as the server's worker thread does."""
    stop, waits = threading.Event(), []

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(TICK_S)
            now = time.perf_counter()
            waits.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    start = time.perf_counter()
    worker = threading.Thread(target=prepare)
    worker.start()
    worker.join()
    prepared_s = time.perf_counter() - start
    stop.set()
    ticker.join()
    return 1e3 * max(waits), 1e3 * prepared_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer("default" if args.tokenizer is None else args.tokenizer)
    if tokenizer is None:
        print("no tokenizer to be found for --tokenizer", file=sys.stderr)
        return 2
    workload = {
        key: getattr(args, key)
        for key in ("tokenizer", "turns", "system_len", "user_len", "answer_len", "repeats")
    }
    body = chat_body(tokenizer, args)
    # chat_prompt reads these two of the server's state; no context limit applies here
    states = {
        arm: SimpleNamespace(tokenizer=arm_tokenizer, max_model_len=1 << 20)
        for arm, arm_tokenizer in zip(ARMS, (tokenizer, _EncodeHoldingGil(tokenizer)), strict=True)
    }
    workload["body_bytes"] = len(body)
    run = recording.Run("prepare_stall", args, "prepare_stall", workload, argv)

    def prepare(arm: str) -> Callable[[], Any]:
        request = ChatCompletionRequest.model_validate(orjson.loads(body))
        return lambda: chat_prompt(states[arm], request)  # type: ignore[arg-type]

    for arm in ARMS:  # the chat template compiles and the caches fill on the first
        prepare(arm)()
    token_ids = {arm: prepare(arm)().prompt.token_ids for arm in ARMS}
    if len(set(token_ids.values())) != 1:
        raise SystemExit("the arms tokenized the request differently: no comparison")
    num_tokens = len(token_ids["tokenizer"])
    samples: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            samples[arm].append(stall(prepare(arm)))
    figures: dict[str, Any] = {}
    for arm, pairs in samples.items():
        figures[f"{arm}_stall_median_ms"] = round(statistics.median(p[0] for p in pairs), 2)
        figures[f"{arm}_prepare_median_ms"] = round(statistics.median(p[1] for p in pairs), 2)
        print(f"{arm}: stall {figures[f'{arm}_stall_median_ms']} ms, prepare "
              f"{figures[f'{arm}_prepare_median_ms']} ms (medians of {args.repeats})")  # fmt: skip
    details = {"prompt_tokens": num_tokens, "tick_s": TICK_S, "samples_ms": samples}
    run.finish(figures, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
