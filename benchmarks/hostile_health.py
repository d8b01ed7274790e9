"""How long /health waits while hostile requests run (CPU, the embedded model).

Starts `tandem serve` (embedded model, CPU, default limits) in a subprocess; for each
scenario sends the hostile request(s) while a thread GETs /health back to back, and records
the slowest and median /health answer, the hostile request's status and duration, and the
server's resident memory before and after. Target: every /health answer under 100 ms.
The client runs in this process, apart from the server, so its own garbage collection and
parsing do not count against the server.

    python benchmarks/hostile_health.py --out benchmarks/results/hostile_health.json
    python benchmarks/hostile_health.py --scenarios chat_15mb,messages_400k
    python benchmarks/hostile_health.py --scenarios messages_400k_x4 --repeat 5 \
        --baseline /path/to/other/checkout      # before/after, alternating, one run

Scenarios follow the issue's sizes. On a build without the fixes `n_2e70` wedges the
server for good (run it last, or leave it out).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
TARGET_HEALTH_S = 0.1


def _items(item: bytes, count: int) -> bytes:
    return b"[" + b",".join([item] * count) + b"]"


def _messages(count: int) -> bytes:
    return b'{"max_tokens": 1, "messages": ' + _items(b'{"role": "user", "content": "a"}',
                                                      count) + b"}"


CHAT_15MB = json.dumps({"messages": [{"role": "user", "content": "ab " * 5_200_000}],
                        "max_tokens": 1}).encode()
SCENARIOS: dict[str, tuple[str, Callable[[], bytes], int]] = {
    # name: (path, body, how many at once)
    "n_2e70": ("/v1/completions", lambda: b'{"prompt": "hi", "max_tokens": 1, '
                                          b'"n": 1180591620717411303424}', 1),
    "prompts_2_5m": ("/v1/completions",
                     lambda: b'{"max_tokens": 1, "prompt": ' + _items(b'"hi"', 2_500_000) + b"}",
                     1),
    "token_lists_3_5m": ("/v1/completions",
                         lambda: b'{"max_tokens": 1, "prompt": ' + _items(b"[1]", 3_500_000)
                         + b"}", 1),
    "chat_15mb": ("/v1/chat/completions", lambda: CHAT_15MB, 1),
    "tokenize_15mb": ("/tokenize", lambda: json.dumps({"prompt": "ab " * 5_200_000}).encode(), 1),
    "messages_400k": ("/v1/chat/completions", lambda: _messages(400_000), 1),
    "messages_400k_x4": ("/v1/chat/completions", lambda: _messages(400_000), 4),
    "detokenize_6mb": ("/detokenize", lambda: b'{"tokens": ' + _items(b"30", 2_000_000) + b"}",
                       1),
    "lone_surrogate": ("/v1/completions", lambda: b'{"prompt": "\\ud800", "max_tokens": 1}', 1),
    "chat_ok": ("/v1/chat/completions",
                lambda: b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}', 1),
}


class HealthProbe(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.latencies_s: list[float] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    client.get(self.url + "/health")
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                self.latencies_s.append(time.perf_counter() - started)
                self.stop.wait(0.005)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _server_log() -> Any:
    """Where the server's stderr goes: $HOSTILE_SERVER_LOG, or nowhere."""
    path = os.environ.get("HOSTILE_SERVER_LOG")
    return open(path, "wb") if path else subprocess.DEVNULL  # noqa: SIM115 - the child owns it


def _start_server(port: int, root: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port),
                               "--device", "cpu", "--log-level", "warning"], cwd=root, env=env,
                              stdout=subprocess.DEVNULL, stderr=_server_log())
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.kill()
    raise RuntimeError("the server did not become healthy")


def _run(url: str, pid: int, name: str, timeout_s: float) -> dict[str, Any]:
    path, make_body, num_at_once = SCENARIOS[name]
    body = make_body()
    rss_before = _rss_mib(pid)
    probe = HealthProbe(url)
    probe.start()
    time.sleep(0.2)
    outcomes: list[Any] = [None] * num_at_once

    def send(index: int) -> None:
        started = time.perf_counter()
        try:
            response = httpx.post(url + path, content=body, timeout=timeout_s,
                                  headers={"Content-Type": "application/json"})
            outcomes[index] = (response.status_code, time.perf_counter() - started)
        except httpx.HTTPError as exc:
            outcomes[index] = (type(exc).__name__, time.perf_counter() - started)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(num_at_once)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    time.sleep(0.3)
    probe.stop.set()
    probe.join()
    time.sleep(1.0)
    latencies = probe.latencies_s
    return {"scenario": name, "path": path, "body_bytes": len(body), "at_once": num_at_once,
            "statuses": [o[0] for o in outcomes], "request_s": max(o[1] for o in outcomes),
            "health_max_s": max(latencies), "health_median_s": statistics.median(latencies),
            "health_probes": len(latencies), "health_errors": probe.errors[:3],
            "health_under_target": max(latencies) < TARGET_HEALTH_S,
            "rss_before_mib": rss_before, "rss_after_mib": _rss_mib(pid)}


def _commit(root: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() or "unknown"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, from: {', '.join(SCENARIOS)}")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds one hostile request may take (default 180)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the scenario list this many times (default 1)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout (e.g. before a change): its server runs beside "
                             "this one's and each scenario alternates between the two")
    args = parser.parse_args()
    args.names = [name for name in args.scenarios.split(",") if name]
    unknown = sorted(set(args.names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    return args


def main() -> int:
    args = _parse_args()
    roots = {"this": ROOT} if args.baseline is None else {"baseline": args.baseline.resolve(),
                                                           "this": ROOT}
    servers: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    load_before = os.getloadavg()
    results = []
    try:
        for arm, root in roots.items():
            port = _free_port()
            servers[arm] = (f"http://127.0.0.1:{port}", _start_server(port, root))
        for repeat in range(args.repeat):
            for name in args.names:
                for arm, (url, server) in servers.items():
                    result = _run(url, server.pid, name, args.timeout)
                    results.append({"arm": arm, "repeat": repeat, **result})
                    print(json.dumps(results[-1]), flush=True)
    finally:
        for _, server in servers.values():
            server.terminate()
            server.wait(60)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        machine = {"cpus": os.cpu_count(), "load_average_before": load_before,
                   "load_average_after": os.getloadavg()}
        arms = {arm: {"root": str(root), "commit": _commit(root)} for arm, root in roots.items()}
        args.out.write_text(json.dumps({"target_health_s": TARGET_HEALTH_S, "machine": machine,
                                        "command": " ".join(sys.argv), "arms": arms,
                                        "results": results}, indent=2) + "\n")
    _print_table(results)
    return 0 if all(r["health_under_target"] for r in results if r["arm"] == "this") else 1


def _print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'scenario':<18} {'arm':<9} {'runs':>4} {'status':>10} {'request s':>10} "
          f"{'health max ms':>14} {'(median run)':>13} {'median ms':>10} "
          f"{'RSS MiB first/last':>20}")
    for key in dict.fromkeys((r["scenario"], r["arm"]) for r in results):
        runs = [r for r in results if (r["scenario"], r["arm"]) == key]
        statuses = ",".join(str(s) for s in sorted({s for r in runs for s in r["statuses"]},
                                                     key=str))
        maxima_ms = [r["health_max_s"] * 1000 for r in runs]
        print(f"{key[0]:<18} {key[1]:<9} {len(runs):>4} {statuses:>10} "
              f"{max(r['request_s'] for r in runs):>10.2f} {max(maxima_ms):>14.0f} "
              f"{statistics.median(maxima_ms):>13.0f} "
              f"{statistics.median(r['health_median_s'] for r in runs) * 1000:>10.1f} "
              f"{runs[0]['rss_before_mib']:>9.0f}/{runs[-1]['rss_after_mib']:<10.0f}")


if __name__ == "__main__":
    raise SystemExit(main())
