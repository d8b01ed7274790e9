"""Property tests: random workloads through the KV cache manager and the scheduler."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.core.kv_allocation import AllocateStep, RunningAllocs, WaitingAlloc
from actors.core.kv_cache_manager import KVCacheManager
from actors.core.request import RequestStatus
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.messages import SchedulerOutput
from tests.actors._kv_helpers import FakeRunner, assert_workload_drained, engine_request

_TEMPLATES = [[random.Random(seed).randrange(30) for _ in range(64)] for seed in range(3)]


def _prompt(rng: random.Random, length: int) -> list[int]:
    """A prompt that often shares a prefix with other prompts (prefix-cache hits)."""
    shared = rng.randrange(length + 1) if rng.random() < 0.7 else 0
    template = _TEMPLATES[rng.randrange(len(_TEMPLATES))]
    return template[: min(shared, len(template))] + [rng.randrange(30) for _ in range(length)]


# ---- KV cache manager ----------------------------------------------------------------


@dataclass
class _ModelRequest:
    token_ids: list[int]
    num_computed_tokens: int


def _write_and_check(
    kv: dict[int, list[int | None]],
    block_ids: tuple[int, ...],
    request: _ModelRequest,
    start: int,
    end: int,
    block_size: int,
) -> None:
    for position in range(start, end):
        block = kv.setdefault(block_ids[position // block_size], [None] * block_size)
        block[position % block_size] = request.token_ids[position]
    for position in range(end):
        stored = kv[block_ids[position // block_size]][position % block_size]
        assert stored == request.token_ids[position], f"stale KV at position {position}"


@settings(deadline=None, max_examples=200)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(1, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    prefix_caching=st.booleans(),
    num_ops=st.integers(1, 60),
)
def test_kv_cache_manager_random_operations(
    seed: int, num_blocks: int, block_size: int, prefix_caching: bool, num_ops: int
) -> None:
    rng = random.Random(seed)
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    held: dict[str, _ModelRequest] = {}
    kv: dict[int, list[int | None]] = {}
    for op_index in range(num_ops):
        free_ids = tuple(rid for rid in held if rng.random() < 0.2)
        for rid in free_ids:
            del held[rid]
        running = []
        for rid, request in held.items():
            if rng.random() < 0.6:
                request.token_ids += [rng.randrange(30) for _ in range(rng.randrange(3))]
                target = rng.randint(request.num_computed_tokens, len(request.token_ids))
                running.append((rid, target))
        waiting = [
            _ModelRequest(_prompt(rng, rng.randint(1, 20)), 0) for _ in range(rng.randrange(3))
        ]
        entries = tuple(
            WaitingAlloc(
                f"w{op_index}.{i}",
                tuple(w.token_ids),
                len(w.token_ids),
                rng.randint(1, 30),
                rng.choice([None, "salt"]),
            )
            for i, w in enumerate(waiting)
        )
        allocation = manager.allocate_step(
            AllocateStep(
                free_ids,
                RunningAllocs(tuple(rid for rid, _ in running), tuple(n for _, n in running)),
                entries,
                rng.randrange(40),
            )
        )
        manager.check_invariants()
        assert allocation.num_running_ok <= len(running)
        for rid, num_tokens in running[: allocation.num_running_ok]:
            request = held[rid]
            block_ids = manager.block_ids(rid)
            assert len(block_ids) * block_size >= num_tokens
            _write_and_check(
                kv, block_ids, request, request.num_computed_tokens, num_tokens, block_size
            )
            request.num_computed_tokens = num_tokens
        if allocation.num_running_ok < len(running):
            assert allocation.waiting == ()
        for grant, entry, request in zip(allocation.waiting, entries, waiting):
            assert grant.request_id == entry.request_id and grant.num_new_tokens >= 1
            assert grant.num_cached_tokens + grant.num_new_tokens <= len(request.token_ids)
            assert grant.block_ids == manager.block_ids(entry.request_id)
            end = grant.num_cached_tokens + grant.num_new_tokens
            _write_and_check(kv, grant.block_ids, request, grant.num_cached_tokens, end, block_size)
            request.num_computed_tokens = end
            held[entry.request_id] = request
        for entry in entries[len(allocation.waiting) :]:
            assert not manager.has_request(entry.request_id)
    manager.free(list(held))
    manager.check_invariants()
    usage = manager.stats()
    assert usage.num_used_blocks == 0 and usage.num_free_blocks == num_blocks


# ---- scheduler ----------------------------------------------------------------------


@st.composite
def _scheduler_configs(draw: st.DrawFn) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    return SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_model_len=draw(st.integers(4, 48)),
        block_size=block_size,
        max_steps_in_flight=draw(st.sampled_from([1, 2])),
    )


def _check_scheduler(scheduler: Scheduler, manager: KVCacheManager) -> None:
    manager.check_invariants()
    assert scheduler.num_running <= scheduler.config.max_num_seqs
    for request_id in [r.request_id for r in scheduler.unfinished_requests()]:
        request = scheduler.get_request(request_id)
        assert request is not None and not request.is_finished
        max_tokens = request.max_total_tokens - request.num_prompt_tokens
        assert request.num_output_tokens + request.num_output_placeholders <= max_tokens
        assert request.num_computed_tokens <= request.num_tokens_with_placeholders
        if request.status is RequestStatus.RUNNING:
            assert manager.block_ids(request_id) == tuple(request.block_ids)


def _check_output(out: SchedulerOutput, config: SchedulerConfig) -> None:
    assert 0 < out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(set(out.scheduled_request_ids)) == out.num_reqs <= config.max_num_seqs
    new_ids = [new.request_id for new in out.new_requests]
    assert list(out.scheduled_request_ids) == list(out.cached_requests.request_ids) + new_ids


@settings(deadline=None, max_examples=400)
@given(
    config=_scheduler_configs(),
    extra_blocks=st.integers(0, 8),
    seed=st.integers(0, 2**32 - 1),
    prefix_caching=st.booleans(),
    num_requests=st.integers(1, 16),
    abort_probability=st.sampled_from([0.0, 0.02, 0.1]),
    eos_probability=st.sampled_from([0.0, 0.1, 0.3]),
)
def test_scheduler_random_workloads(
    config: SchedulerConfig,
    extra_blocks: int,
    seed: int,
    prefix_caching: bool,
    num_requests: int,
    abort_probability: float,
    eos_probability: float,
) -> None:
    rng = random.Random(seed)
    # The pool must hold one request of max_model_len tokens, or nothing can progress.
    num_blocks = -(-config.max_model_len // config.block_size) + extra_blocks
    manager = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(config, manager)
    runner = FakeRunner(
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        manager=manager,
        rng=rng,
        eos_probability=eos_probability,
    )
    arrivals = sorted((rng.randrange(12), index) for index in range(num_requests))
    aborted: set[str] = set()
    for iteration in range(5000):
        while arrivals and arrivals[0][0] <= iteration:
            _, index = arrivals.pop(0)
            max_prompt_len = config.max_model_len - 1
            prompt = _prompt(rng, rng.randint(1, max_prompt_len))[:max_prompt_len]
            max_tokens = rng.choice([None, rng.randint(1, 24)])
            request = engine_request(
                f"r{index}",
                prompt,
                max_tokens=max_tokens,
                arrival_time=float(iteration),
                priority=rng.choice([0, 0, 1]),
                cache_salt=rng.choice([None, "s"]),
            )
            scheduler.add_request(request)
            runner.register(
                request.request_id,
                min(max_tokens or config.max_model_len, config.max_model_len - len(prompt)),
            )
        unfinished = [r.request_id for r in scheduler.unfinished_requests()]
        if unfinished and rng.random() < abort_probability:
            victim = rng.choice(unfinished)
            assert scheduler.abort_requests([victim]) == [victim]
            runner.abort([victim])
            aborted.add(victim)
        if runner.pending_updates and rng.random() < 0.3:
            runner.deliver_oldest(scheduler)
        while (out := scheduler.schedule()) is not None:
            _check_output(out, config)
            runner.execute(out)
            _check_scheduler(scheduler, manager)
        if runner.pending_updates:
            runner.deliver_oldest(scheduler)
            _check_scheduler(scheduler, manager)
        if not arrivals and not scheduler.has_unfinished_requests and not runner.pending_updates:
            break
    else:
        raise AssertionError("the workload did not finish: the scheduler stopped making progress")
    assert_workload_drained(
        scheduler,
        manager,
        num_blocks,
        num_requests,
        runner.finished,
        aborted,
        runner.num_outputs,
        runner.max_tokens,
    )
