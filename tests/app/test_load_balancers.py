"""tandem behind the load balancers deploy/ ships: HAProxy (deploy/haproxy/haproxy.cfg, as
shipped, addresses from its variables) and nginx (deploy/nginx/tandem.conf, addresses and
port rewritten) in front of two `tandem serve` replicas on loopback.

Streams pass through as they are generated; a full pool's 429 and its Retry-After reach the
client; a replica that drains (SIGTERM) is taken out by HAProxy on its /health 503 while
it still answers, one killed mid-run within the health-check bound, and meanwhile every
request sent through either balancer succeeds: what reached the draining or dead replica is
retried on the other. Only the stream that the killed replica was generating fails, and
its client sees that it did.

The binaries come from Debian's packages, unpacked into `.cache/load-balancers/` (see
tests/app/_load_balancers.py); the test is skipped where apt-get cannot fetch them.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.app._lb_clients import HeldStream, TimedStream, Traffic, wait_for_log
from tests.app._load_balancers import (
    HAPROXY_CONFIG,
    NGINX_CONFIG,
    BalancerProcess,
    start_haproxy,
    start_nginx,
    unpacked,
)
from tests.app._serve_process import ServeProcess, alive

pytestmark = pytest.mark.slow

REPLICA_FLAGS = ("--max-num-seqs", "2", "--max-queued-requests", "0", "--shutdown-timeout", "20")
"""Two requests fill a replica (the third gets 429); a drain outlasts the health checks."""


def _check_settings() -> tuple[float, int]:
    """The shipped configuration's health-check interval (s) and failures to take out."""
    text = HAPROXY_CONFIG.read_text()
    inter = re.search(r"default-server .*\binter (\d+)s\b", text)
    fall = re.search(r"default-server .*\bfall (\d+)\b", text)
    assert inter and fall, "deploy/haproxy/haproxy.cfg sets no check interval and fall count"
    return float(inter.group(1)), int(fall.group(1))


def _nginx_fail_timeout_s() -> float:
    """How long the shipped nginx configuration skips a replica after a failure."""
    found = re.search(r"\bfail_timeout=(\d+)s\b", NGINX_CONFIG.read_text())
    assert found, "deploy/nginx/tandem.conf sets no fail_timeout"
    return float(found.group(1))


@dataclass
class Pool:
    replicas: list[ServeProcess]
    haproxy: BalancerProcess
    nginx: BalancerProcess
    tmp: Path

    @property
    def balancers(self) -> list[BalancerProcess]:
        return [self.haproxy, self.nginx]


def _address(replica: ServeProcess) -> str:
    return str(urlsplit(replica.url).netloc)


def _start_replicas(tmp: Path, count: int) -> list[ServeProcess]:
    """Started side by side: each spends most of its start loading the model."""
    started: dict[int, ServeProcess] = {}
    errors: list[BaseException] = []

    def start(index: int) -> None:
        try:
            started[index] = ServeProcess(tmp / f"replica{index + 1}.log", *REPLICA_FLAGS)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for replica in started.values():
            replica.kill()
        raise errors[0]
    return [started[i] for i in range(count)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    haproxy = unpacked("haproxy", "usr/sbin/haproxy")  # skips before any replica starts
    nginx = unpacked("nginx", "usr/sbin/nginx")
    tmp = tmp_path_factory.mktemp("load_balancers")
    replicas = _start_replicas(tmp, 2)
    addresses = [_address(r) for r in replicas]
    balancers: list[BalancerProcess] = []
    try:
        balancers.append(start_haproxy(haproxy, addresses, tmp))
        balancers.append(start_nginx(nginx, addresses, tmp))
        yield Pool(replicas, balancers[0], balancers[1], tmp)
    finally:
        for balancer in balancers:
            balancer.stop()
        for replica in replicas:
            if replica.proc.poll() is None:
                replica.kill()


def test_streams_pass_through_both_balancers_as_they_are_generated(pool: Pool) -> None:
    for balancer in pool.balancers:
        stream = TimedStream(balancer.url, max_tokens=16)
        stream.run()
        assert stream.completed, f"{balancer.proc.args[0]}: {stream.error}"
        assert stream.num_tokens == 16
        # Buffered, every event would arrive at once when the stream ends.
        assert stream.done_at - stream.first_token_at > 0.25, balancer.proc.args[0]


def test_a_full_pool_passes_429_and_its_retry_after_on(pool: Pool) -> None:
    held = [HeldStream(r.url, max_tokens=500) for r in pool.replicas for _ in range(2)]
    try:
        for balancer in pool.balancers:
            response = httpx.post(
                balancer.url + "/v1/completions",
                json={"prompt": [1, 2, 3], "max_tokens": 2},
                timeout=30,
            )
            assert response.status_code == 429, (balancer.proc.args[0], response.text)
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == 429
    finally:
        for stream in held:
            stream.close()
    for replica in pool.replicas:
        _wait_until_it_admits(replica.url)


def _wait_until_it_admits(url: str) -> None:
    """Once the closed streams' slots are free again (their aborts take a step)."""
    deadline = time.monotonic() + 10
    while True:
        response = httpx.post(
            url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=30
        )
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.status_code == 200


def test_a_draining_replica_leaves_the_pool_while_it_still_answers(pool: Pool) -> None:
    """SIGTERM: /health turns 503, HAProxy takes the replica out for it (a 503 check, not a
    refused connection), while the replica goes on streaming what it had; requests that
    meanwhile reach it are refused with 503 and retried on the other by both balancers."""
    inter_s, fall = _check_settings()
    draining = pool.replicas[1]
    in_flight = HeldStream(draining.url, max_tokens=500)
    with Traffic([b.url for b in pool.balancers]) as traffic:
        traffic.wait_for(4)
        draining.proc.send_signal(signal.SIGTERM)
        wait_for_log(
            pool.haproxy,
            r"Server tandem/replica2 is DOWN, reason: Layer7 wrong status, code: 503",
            inter_s * (fall + 1) + 2,
        )
        assert in_flight.read_more(), "the draining replica stopped streaming"
        assert httpx.get(draining.url + "/health", timeout=5).status_code == 503
        traffic.wait_for(traffic.num_sent + 8)
    in_flight.close()  # its drain ends: nothing is left in flight
    assert draining.proc.wait(timeout=30) == 0
    traffic.assert_all_completed()
    assert traffic.num_sent >= 12


def test_a_killed_replica_is_taken_out_and_new_requests_go_to_the_other(pool: Pool) -> None:
    inter_s, fall = _check_settings()
    _rejoin_if_drained(pool, 1)
    # Long enough that the killed replica's stream is still running when it dies.
    streams = [TimedStream(pool.haproxy.url, max_tokens=120) for _ in range(2)]
    threads = [threading.Thread(target=s.run) for s in streams]
    for stream, thread in zip(streams, threads, strict=True):
        thread.start()  # one after the other: leastconn sends the second to the other replica
        assert stream.first_token.wait(30), "a stream through HAProxy did not start"
    victim = pool.replicas[0]
    with Traffic([b.url for b in pool.balancers]) as traffic:
        victim.kill()
        killed_at = time.monotonic()
        waited_s = wait_for_log(pool.haproxy, r"Server tandem/replica1 is DOWN", 30.0)
        assert time.monotonic() - killed_at < inter_s * fall + inter_s, f"{waited_s:.1f} s"
        traffic.wait_for(traffic.num_sent + 8)
    for thread in threads:
        thread.join(timeout=60)
    traffic.assert_all_completed()
    # leastconn put one stream on each replica: the survivor's completes, the other's
    # client sees its stream break off (no [DONE]) instead of hanging.
    outcomes = sorted((s.completed, s.error is not None) for s in streams)
    assert outcomes == [(False, True), (True, False)], [s.error for s in streams]


def _rejoin_if_drained(pool: Pool, index: int) -> None:
    """A replica drained by the previous test starts again on its port; HAProxy sends it
    requests once its /health is 200 again (after `rise` checks)."""
    replica = pool.replicas[index]
    if replica.proc.poll() is None and alive(replica.proc.pid):
        return
    port = urlsplit(replica.url).port
    restarted_at = time.monotonic()
    pool.replicas[index] = ServeProcess(
        pool.tmp / f"replica{index + 1}-again.log", *REPLICA_FLAGS, "--port", str(port)
    )
    wait_for_log(pool.haproxy, rf"Server tandem/replica{index + 1} is UP", 10.0)
    # nginx does not probe: it tries the replica again fail_timeout after the last request
    # that failed on it, which came before the restart.
    time.sleep(max(0.0, restarted_at + _nginx_fail_timeout_s() - time.monotonic()))
