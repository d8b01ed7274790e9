"""A front end's engine cores as one: requests to the core the balancer picks, aborts to the
core that has the request (every core for one it does not know), questions to every core
with the answers summed, and the most silent core's silence as the group's."""

from __future__ import annotations

from typing import Any

import pytest

from actors.frontend.dp_balancer import DataParallelBalancer
from actors.frontend.engine_client import EngineUnavailable
from actors.frontend.engine_group import EngineGroup
from actors.frontend.output_stream import RequestStream
from actors.protocol.messages import (
    EngineRequest,
    PrefixCacheReset,
    SchedulerStats,
    UtilityResult,
)
from actors.protocol.sampling_params import SamplingParams


def _stats(running: int, waiting: int, free: int, total: int, rows: int | None) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=waiting,
        num_preemptions_total=1,
        num_total_kv_blocks=total,
        num_free_kv_blocks=free,
        kv_usage_perc=1 - free / total,
        prefix_cache_queries_tokens=100,
        prefix_cache_hits_tokens=10,
        num_free_rows=rows,
    )


class FakeClient:
    """What EngineGroup uses of an EngineClient, recording what it was sent."""

    def __init__(self, stats: SchedulerStats, heard_at: float) -> None:
        self.requests: list[str] = []
        self.aborted: list[str] = []
        self.failed: list[str] = []
        self.stats = stats
        self.last_heard_at = heard_at
        self.is_running = True
        self.has_tokenizer = True
        self.error: str | None = None

    def add_request(self, request: EngineRequest) -> RequestStream:
        self.requests.append(request.request_id)
        return RequestStream(request.request_id, len(request.prompt_token_ids))

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    def fail_all(self, message: str) -> None:
        self.failed.append(message)

    async def call(self, method: str, timeout_s: float = 10.0) -> UtilityResult:
        if self.error is not None:
            return UtilityResult(0, error=self.error)
        if method == "stats":
            return UtilityResult(0, stats=self.stats)
        if method == "reset_prefix_cache":
            return UtilityResult(0, prefix_cache_reset=PrefixCacheReset(3, 1))
        return UtilityResult(0)


def _request(request_id: str, first_token: int) -> EngineRequest:
    return EngineRequest(request_id, (first_token,) * 32, SamplingParams(), 0.0)


def _group(*clients: FakeClient) -> EngineGroup:
    return EngineGroup(clients, DataParallelBalancer(len(clients), 16))  # type: ignore[arg-type]


def test_requests_go_where_the_balancer_says_and_aborts_follow_them() -> None:
    a = FakeClient(_stats(0, 0, 10, 10, 4), 5.0)
    b = FakeClient(_stats(0, 0, 10, 10, 4), 3.0)
    group = _group(a, b)
    for i in range(4):
        group.add_request(_request(f"r{i}", i))
    assert (a.requests, b.requests) == (["r0", "r2"], ["r1", "r3"])
    assert [group.core_of(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
    group.abort(["r1", "r2", "gone"])
    assert sorted(a.aborted) == ["gone", "r2"] and sorted(b.aborted) == ["gone", "r1"]
    assert group.core_of("r1") is None
    group.fail_all("dead")
    assert a.failed == b.failed == ["dead"]
    assert group.last_heard_at == 3.0


def test_one_core_needs_no_balancer() -> None:
    only = FakeClient(_stats(0, 0, 10, 10, 4), 1.0)
    group = EngineGroup([only])  # type: ignore[list-item]
    group.add_request(_request("x", 1))
    group.abort(["x"])
    assert only.requests == only.aborted == ["x"] and group.core_of("x") == 0


async def test_questions_go_to_every_core_and_answers_add_up() -> None:
    a = FakeClient(_stats(2, 1, 30, 100, 4), 0.0)
    b = FakeClient(_stats(3, 0, 80, 100, None), 0.0)
    group = _group(a, b)
    per_core = await group.stats_by_core()
    assert [s.num_running for s in per_core] == [2, 3]
    total = await group.stats()
    assert (total.num_running, total.num_waiting) == (5, 1)
    assert (total.num_total_kv_blocks, total.num_free_kv_blocks) == (200, 110)
    assert total.kv_usage_perc == pytest.approx(0.45)
    assert (total.prefix_cache_queries_tokens, total.num_preemptions_total) == (200, 2)
    assert total.num_free_rows is None  # a core without rows
    reset = await group.reset_prefix_cache()
    assert (reset.num_dropped_blocks, reset.num_kept_blocks) == (6, 2)
    await group.check_kv_invariants()
    b.error = "block 7 leaked"
    with pytest.raises(AssertionError, match="engine 1: block 7 leaked"):
        await group.check_kv_invariants()
    with pytest.raises(EngineUnavailable, match="block 7 leaked"):
        await group.stats()


def test_finished_requests_leave_the_owner_table() -> None:
    clients = [FakeClient(_stats(0, 0, 1, 1, 1), 0.0) for _ in range(2)]
    group = _group(*clients)
    streams: list[Any] = []
    for i in range(3000):
        stream = group.add_request(_request(f"r{i}", i))
        stream.push(finish_reason="stop")
        streams.append(stream)
    assert len(group._owners) < 1100  # swept as it grew
