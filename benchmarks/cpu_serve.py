"""The CPU serving benchmark: `tandem serve` (embedded model, float32) driven by
`tandem bench serve` at several concurrencies, next to the offline engine's throughput on
the same prompts, with the server/offline ratio at the highest concurrency.

    python -m benchmarks.cpu_serve --output benchmarks/results/cpu_serve.json

Order: offline, server, offline; the offline figure is the median of the two runs, and
the server never shares the CPU with the offline engine. Prefix caching is off on both
sides: every level sends the same prompts, and a cache would let later levels skip their
prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.run_info import command_line, load_average, process_cpu_s, run_header
from benchmarks.serve_workload import (
    DEFAULT_TOKEN_ID_RANGE,
    prompts_digest,
    token_id_prompts,
)

SERVER_TARGET_RATIO = 0.8
_READY_TIMEOUT_S = 300.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--max-num-seqs", type=int, default=64, help="server and offline engine")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests per level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads of the server and the offline engine (default 1: "
                        "the benchmark machines are shared, and the load client needs a core)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/cpu_serve.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    record: dict[str, Any] = {"benchmark": "cpu_serve", **run_header(command_line()),
                              "order": "offline, server sweep, server top level again, offline",
                              "workload": _workload(args), "offline_runs": []}
    prompts = token_id_prompts(args.num_prompts, args.input_len, args.seed,
                               DEFAULT_TOKEN_ID_RANGE)
    record["workload"]["prompts_sha256_16"] = prompts_digest(prompts)
    record["offline_runs"].append(_offline_run(prompts, args))
    _write(args.output, record)
    record["serve"] = _serve_session(args)
    _write(args.output, record)
    record["offline_runs"].append(_offline_run(prompts, args))
    record["server_vs_offline"] = compare(record["serve"], record["offline_runs"])
    record["load_average_after"] = load_average()
    _write(args.output, record)
    print(json.dumps(record["server_vs_offline"], indent=2))
    print(f"wrote {args.output}")
    return 0


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": "default (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized)",
            "device": "cpu", "dtype": "float32", "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True,
            "temperature": 0.0, "seed": args.seed, "max_num_seqs": args.max_num_seqs,
            "token_id_range": list(DEFAULT_TOKEN_ID_RANGE), "concurrency": args.concurrency,
            "torch_threads": args.threads, "prefix_caching": False}


def _offline_run(prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """One timed `LLM.generate` over every prompt, after a short warmup on other prompts."""
    from actors.protocol.sampling_params import SamplingParams

    llm = _offline_llm(args.max_num_seqs)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    warm = token_id_prompts(4, args.input_len, args.seed + 1, DEFAULT_TOKEN_ID_RANGE)
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    load_before = load_average()
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    elapsed_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"runner": llm.runner, "elapsed_s": elapsed_s, "cpu_s": cpu_s,
            "num_output_tokens": num_tokens,
            "output_tok_s": num_tokens / elapsed_s,
            "request_throughput_req_s": len(prompts) / elapsed_s,
            "load_average_before": load_before, "load_average_after": load_average()}


_LLM_CACHE: dict[int, Any] = {}


def _offline_llm(max_num_seqs: int) -> Any:
    from app.llm import LLM

    if max_num_seqs not in _LLM_CACHE:
        _LLM_CACHE[max_num_seqs] = LLM("default", device="cpu", dtype="float32",
                                       max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    return _LLM_CACHE[max_num_seqs]


def _serve_session(args: argparse.Namespace) -> dict[str, Any]:
    """One server: the sweep over every level, then the top level once more with the
    server's CPU time measured around it."""
    port = _free_port()
    server_cmd = [sys.executable, "-m", "app.cli", "serve", "--device", "cpu", "--dtype",
                  "float32", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
                  "--no-prefix-caching", "--log-level", "warning"]
    top = str(max(int(c) for c in args.concurrency.split(",")))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, env=env)
    try:
        _wait_healthy(port, server)
        sweep = _bench(args, port, args.concurrency, args.warmup)
        cpu_before_s = process_cpu_s(server.pid)
        repeat = _bench(args, port, top, 0)
        repeat["server_cpu_s"] = process_cpu_s(server.pid) - cpu_before_s
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    return {"server_command": f"OMP_NUM_THREADS={args.threads} " + _display(server_cmd),
            "sweep": sweep, "top_level_repeat": repeat}


def _bench(args: argparse.Namespace, port: int, concurrency: str, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.json"
        cmd = [sys.executable, "-m", "app.cli", "bench", "serve", "--base-url",
               f"http://127.0.0.1:{port}", "--endpoint", "completions",
               "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--concurrency", concurrency,
               "--request-rate", "inf", "--warmup", str(warmup), "--ignore-eos",
               "--temperature", "0", "--seed", str(args.seed), "--output", str(out)]
        subprocess.run(cmd, check=True)
        record: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    record["command"] = _display(cmd[:-2])
    return record


def _display(cmd: list[str]) -> str:
    # `python -m app.cli X` is what `tandem X` runs; show the console-script form.
    shown = ["tandem", *cmd[3:]] if cmd[1:3] == ["-m", "app.cli"] else cmd
    return " ".join(shown)


def _wait_healthy(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"tandem serve exited with code {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("tandem serve did not become healthy")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def compare(serve: dict[str, Any], offline_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Server / offline output tokens per second at the top concurrency (medians of the two
    runs each, taken in ABBA order), and per CPU-second, which the machine's other load
    disturbs less than wall time."""
    top_level = max(serve["sweep"]["levels"], key=lambda level: level["concurrency"])
    repeat = serve["top_level_repeat"]
    server_rates = [top_level["output_throughput_tok_s"],
                    repeat["levels"][0]["output_throughput_tok_s"]]
    offline_rates = [run["output_tok_s"] for run in offline_runs]
    server_tok_per_cpu_s = repeat["levels"][0]["total_output_tokens"] / repeat["server_cpu_s"]
    offline_tok_per_cpu_s = statistics.median(
        run["num_output_tokens"] / run["cpu_s"] for run in offline_runs)
    ratio = statistics.median(server_rates) / statistics.median(offline_rates)
    return {"concurrency": top_level["concurrency"],
            "server_output_tok_s_runs": server_rates, "offline_output_tok_s_runs": offline_rates,
            "ratio": ratio, "target": SERVER_TARGET_RATIO,
            "meets_target": ratio >= SERVER_TARGET_RATIO,
            "server_output_tok_per_cpu_s": server_tok_per_cpu_s,
            "offline_output_tok_per_cpu_s": offline_tok_per_cpu_s,
            "ratio_per_cpu_s": server_tok_per_cpu_s / offline_tok_per_cpu_s}


def _write(output: Path, record: dict[str, Any]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    os.environ.setdefault("TANDEM_LOG_LEVEL", "warning")
    sys.exit(main())
