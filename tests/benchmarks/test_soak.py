"""Soak, CI form: the real server with the embedded model on CPU, 150 requests from 32
concurrent clients (streamed and not, chat and completions, random lengths and sampling
parameters, 20% disconnecting at random moments, 5% malformed). The long form is
`python -m benchmarks.soak`; both run benchmarks.soak.run_soak, and a few requests through
the long form check what it records."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.server_state import ServeSettings
from benchmarks.soak import SoakConfig, run_soak
from benchmarks.soak_server import InProcessServer
from benchmarks.soak_workload import SoakMix
from tests._command_batch import Command, CommandBatch
from tests.app._server_fixtures import ENGINE, shared_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

API_KEY = "soak-key"
MAX_RSS_GROWTH_MIB = 128.0
"""Generous on purpose: the test process also holds the clients, and glibc's arenas grow
in steps of up to 64 MiB per thread. A leak of one KV block or one response per request
would exceed it only over a far longer run, which is what the long form is for; this
bound catches a per-request leak of roughly 1 MiB."""


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("soak")


@pytest.fixture(scope="module", autouse=True)
def long_form(request: pytest.FixtureRequest, tmp: Path) -> Iterator[CommandBatch]:
    """A few requests through the long form, in a process of its own (it sets up logging
    for itself), started with the module so that it runs beside the CI soak: that one
    keeps one core busy (its server and clients share this process), the long form mostly
    the other. Neither checks a time; the CI soak's counts hold with room to spare if its
    server is slower (one run: 119 completions where it asks for 80, 24 hang-ups where it
    asks for 10), and its resident-memory bound is this process's (the long form's output
    read here is 2.5 kB)."""
    command = Command(
        (sys.executable, "-m", "benchmarks.soak", "--requests", "12", "--concurrency", "4")
        + ("--max-tokens", "4", "--disconnect-within", "2", "--not-a-result")
        + ("--output", str(tmp / "soak.json")),
        timeout_s=300,
        cwd=ROOT,
    )
    with CommandBatch.of_selected(
        request, {"test_the_long_form_records_its_verdict": command}
    ) as batch:
        yield batch


def test_soak_loses_nothing_and_leaks_nothing() -> None:
    # Requests here take up to ~10 s, so hang-ups within 8 s land while queued, during
    # prefill and mid-stream.
    config = SoakConfig(
        num_requests=150,
        concurrency=32,
        seed=7,
        mix=SoakMix(disconnect_within_s=8.0),
        max_rss_growth_mib=MAX_RSS_GROWTH_MIB,
    )
    with InProcessServer(
        ServeSettings(engine=ENGINE, port=0, api_key=API_KEY), shared_model()
    ) as server:
        report = run_soak(server, config, api_key=API_KEY)
        exit_code = server.stop()
    summary = {
        k: report[k]
        for k in (
            "outcomes",
            "outcomes_by_plan",
            "client_aborts",
            "num_5xx",
            "elapsed_s",
            "server_finish_reasons",
            "after",
        )
    }
    summary["rss_mib"] = {k: v for k, v in report["rss_mib"].items() if not k.startswith("series")}
    print(json.dumps(summary, indent=1))
    assert report["passed"], (report["problems"], report["failures"])
    outcomes = report["outcomes"]
    # The mix really exercised every path.
    assert outcomes.get("completed", 0) >= 80
    assert outcomes.get("client_aborted", 0) >= 10
    assert set(report["client_aborts"]) == {"mid-stream", "before any output"}
    assert outcomes.get("rejected", 0) >= 3
    assert sum(outcomes.values()) == config.num_requests
    # Every request the engine ended normally was seen by a client that read to the end;
    # the engine's aborts are the clients' disconnects.
    server_reasons = report["server_finish_reasons"]
    client_reasons = report["client_finish_reasons"]
    assert server_reasons.get("stop", 0) + server_reasons.get("length", 0) >= client_reasons.get(
        "stop", 0
    ) + client_reasons.get("length", 0)
    assert exit_code == 0


def test_the_long_form_records_its_verdict(long_form: CommandBatch, tmp: Path) -> None:
    result = long_form.result("test_the_long_form_records_its_verdict")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((tmp / "soak.json").read_text())
    assert record["workload"]["num_requests"] == 12 and record["workload"]["torch_threads"] == 1
    assert record["figures"]["passed"] is True and record["figures"]["num_5xx"] == 0
    assert sum(v for k, v in record["figures"].items() if k.startswith("outcomes_")) == 12
    assert record["details"]["problems"] == []
    assert record["details"]["after"]["kv_invariants"] == "ok"
