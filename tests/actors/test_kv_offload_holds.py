"""Loads from the offload tiers overlap a step instead of stalling it, through the real
scheduler and KV cache manager and a fake device whose loads land only when the next step
starts (tests/actors/_kv_offload_fakes.py): a request whose prefix is in host memory is not
in the step that loads it, the other rows of that step run, and it runs in the next step
on the loaded KV; requests hitting the same host blocks share one load; a disk read in
flight never stops the other requests; an abort or a prefix-cache reset during a load or a
read leaks nothing."""

from __future__ import annotations

import pytest

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.kv_offload import KVOffload
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.messages import NewRequestData, SchedulerOutput
from tests.actors._kv_helpers import engine_request
from tests.actors._kv_offload_fakes import TOKEN_BYTES, FakeDisk, OffloadFakeRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 12
PROMPT = list(range(13))
"""Three full blocks and one token: the prefix that comes back from the tiers."""
FLUSH = list(range(100, 147))
"""With its one output, every block of the device pool."""
RUNNING = list(range(200, 205))


class _Engine:
    """The scheduler, the KV cache manager and the fake device, stepped by hand."""

    def __init__(self, max_steps_in_flight: int, disk: FakeDisk | None = None) -> None:
        num_host_slots = 3 if disk is not None else 16
        offload = KVOffload(
            num_host_slots, BLOCK_SIZE, BLOCK_SIZE * TOKEN_BYTES, disk, 64 if disk else 0
        )
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, offload=offload)
        config = SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=64,
            block_size=BLOCK_SIZE,
            max_steps_in_flight=max_steps_in_flight,
        )
        self.scheduler = Scheduler(config, self.manager)
        self.runner = OffloadFakeRunner(
            block_size=BLOCK_SIZE, max_num_seqs=4, manager=self.manager, disk=disk
        )
        self.max_steps_in_flight = max_steps_in_flight

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.scheduler.add_request(engine_request(request_id, prompt, max_tokens=max_tokens))
        self.runner.register(request_id, max_tokens)

    def step(self) -> SchedulerOutput | None:
        """Build and run one step; deliver the oldest step's tokens once as many steps as
        the scheduler keeps are in flight (or nothing was built)."""
        out = self.scheduler.schedule()
        if out is not None:
            self.runner.execute(out)
        pending = self.runner.pending_updates
        if pending and (out is None or len(pending) >= self.max_steps_in_flight):
            self.runner.deliver_oldest(self.scheduler)
        self.manager.check_invariants()
        return out

    def run_until_finished(self, *request_ids: str) -> None:
        for _ in range(200):
            if all(r in self.runner.finished for r in request_ids):
                return
            self.step()
        raise AssertionError(f"not finished: {request_ids}")

    def drain(self) -> None:
        """Every request finished: every block back, the tiers' slots all accounted for."""
        self.run_until_finished(*self.runner.max_tokens)
        assert self.scheduler.schedule() is None
        self.manager.check_invariants()
        usage = self.manager.stats()
        assert usage.num_used_blocks == 0 and usage.num_free_blocks == NUM_BLOCKS
        assert self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0

    def evict_prompt(self, num_flushes: int = 1) -> None:
        """PROMPT's blocks leave the device pool for host memory (a second flush pushes
        them on to disk behind a small host tier), then a request runs."""
        self.add("a", PROMPT, 1)
        self.run_until_finished("a")
        for index in range(num_flushes):
            self.add(f"flush-{index}", [t + 1000 * index for t in FLUSH], 1)
            self.run_until_finished(f"flush-{index}")
        self.add("c", RUNNING, 12)
        while self.step() is None or "c" not in self.runner.rows:
            pass


def _new(out: SchedulerOutput | None, request_id: str) -> NewRequestData | None:
    assert out is not None
    return next((new for new in out.new_requests if new.request_id == request_id), None)


def _step_loading(engine: _Engine, request_ids: tuple[str, ...]) -> SchedulerOutput:
    """The next step: it loads the requests' blocks while "c" runs, and runs none of them."""
    out = engine.step()
    assert out is not None and out.kv_transfer is not None
    transfer = out.kv_transfer
    assert len(transfer.load_gpu_block_ids) == 3
    assert transfer.wait_loads_through < transfer.load_id  # the step does not wait for them
    assert "c" in out.scheduled_request_ids  # the other rows run
    for request_id in request_ids:
        assert request_id not in out.scheduled_request_ids and _new(out, request_id) is None
    return out


def _step_until_admitted(engine: _Engine, request_id: str) -> NewRequestData:
    """Step until the held request runs (its loads reported done); "c" runs meanwhile."""
    for _ in range(8):
        out = engine.step()
        new = _new(out, request_id)
        if new is not None:
            return new
        assert out is not None and "c" in out.scheduled_request_ids
    raise AssertionError(f"{request_id} is still held")


@pytest.mark.parametrize("load_delay_steps", [1, 4])
@pytest.mark.parametrize("max_steps_in_flight", [1, 2])
def test_a_host_hit_runs_once_its_loads_are_reported_done(
    max_steps_in_flight: int, load_delay_steps: int
) -> None:
    """However many steps the loads take, the running request steps beside them (no step
    waits for them) and the held one runs in the first step built after the device
    reported them done."""
    engine = _Engine(max_steps_in_flight)
    engine.runner.load_delay_steps = load_delay_steps
    engine.evict_prompt()
    engine.add("d", PROMPT, 3)
    loading = _step_loading(engine, ("d",))
    load_id = loading.kv_transfer.load_id  # type: ignore[union-attr]
    num_held_steps = 0
    while (out := engine.step()) is not None and _new(out, "d") is None:
        assert "c" in out.scheduled_request_ids and engine.scheduler.num_waiting == 1
        transfer = out.kv_transfer
        assert transfer is None or transfer.wait_loads_through < load_id  # nobody waits
        num_held_steps += 1
    assert num_held_steps >= load_delay_steps  # the step that lands it reports it
    assert engine.runner.loads_done_through >= load_id
    new = _new(out, "d")
    assert new is not None and new.num_computed_tokens == 12
    assert new.block_ids[:3] == loading.kv_transfer.load_gpu_block_ids  # type: ignore[union-attr]
    assert out is not None and "d" in out.scheduled_request_ids
    engine.drain()  # the fake device checked every attended token, loaded ones too


def test_requests_hitting_the_same_host_blocks_share_one_load() -> None:
    engine = _Engine(max_steps_in_flight=2)
    engine.evict_prompt()
    for request_id in ("d1", "d2", "d3"):
        engine.add(request_id, PROMPT, 2)
    _step_loading(engine, ("d1", "d2", "d3"))
    out = engine.step()
    for _ in range(8):
        if _new(out, "d1") is not None:
            break
        out = engine.step()
    news = [_new(out, r) for r in ("d1", "d2", "d3")]  # released together
    assert all(new is not None and new.num_computed_tokens == 12 for new in news)
    assert len({new.block_ids[:3] for new in news if new is not None}) == 1
    engine.drain()


def test_an_abort_during_a_load_frees_everything() -> None:
    engine = _Engine(max_steps_in_flight=2)
    engine.evict_prompt()
    engine.add("d", PROMPT, 3)
    _step_loading(engine, ("d",))
    assert engine.scheduler.abort_requests(["d"]) == ["d"]
    engine.runner.abort(["d"])
    for _ in range(3):
        out = engine.step()
        assert out is None or _new(out, "d") is None
    engine.drain()
    engine.add("again", PROMPT, 1)  # the loaded blocks stayed cached: a device hit now
    engine.run_until_finished("again")
    assert engine.manager.stats().prefix_cache_hits_tokens >= 12


def test_a_reset_during_a_load_keeps_the_held_request_right() -> None:
    engine = _Engine(max_steps_in_flight=2)
    engine.evict_prompt()
    engine.add("d", PROMPT, 3)
    _step_loading(engine, ("d",))
    engine.scheduler.free_finished_blocks()  # as POST /reset_prefix_cache does
    engine.manager.reset_prefix_cache()
    assert engine.manager.reset_offload_tiers() > 0
    new = _step_until_admitted(engine, "d")
    assert new.num_computed_tokens == 12  # its blocks were its own
    engine.drain()


def _disk_engine(*, failing: bool = False) -> tuple[_Engine, FakeDisk]:
    """PROMPT's blocks on disk only (host memory holds three blocks), "c" running, and "d"
    (PROMPT) waiting for its reads."""
    disk = FakeDisk(hold_reads=True)
    engine = _Engine(max_steps_in_flight=2, disk=disk)
    engine.evict_prompt(num_flushes=2)
    assert len(disk.files) >= 3
    if failing:
        disk.failing.update(disk.files)
    engine.add("d", PROMPT, 3)
    return engine, disk


def test_a_disk_read_in_flight_never_stops_the_other_requests() -> None:
    engine, disk = _disk_engine()
    for _ in range(4):  # the reads are slow: "c" goes on meanwhile
        out = engine.step()
        assert out is not None and "c" in out.scheduled_request_ids and _new(out, "d") is None
    assert len(disk.reads_in_flight) == 3  # each block read once, however many steps
    disk.end_reads()
    loading = _step_loading(engine, ("d",))
    assert len(loading.kv_transfer.fill_host_slots) == 3  # type: ignore[union-attr]
    new = _step_until_admitted(engine, "d")
    assert new.num_computed_tokens == 12
    engine.drain()
    (_, disk_tier) = engine.manager.stats().kv_tiers
    assert disk_tier.hits_tokens == 12 and disk_tier.loaded_bytes == 3 * BLOCK_SIZE * TOKEN_BYTES


def test_a_failed_disk_read_is_a_miss() -> None:
    engine, disk = _disk_engine(failing=True)
    engine.step()
    disk.end_reads()
    for _ in range(3):
        new = _new(engine.step(), "d")
        if new is not None:
            break
    assert new is not None and new.num_computed_tokens == 0
    engine.drain()


@pytest.mark.parametrize("event", ["abort", "reset"])
def test_an_abort_or_reset_during_a_disk_read_leaks_nothing(event: str) -> None:
    engine, disk = _disk_engine()
    engine.step()
    if event == "abort":
        engine.scheduler.abort_requests(["d"])
        engine.runner.abort(["d"])
    else:
        engine.manager.reset_prefix_cache()
        engine.manager.reset_offload_tiers()
    disk.end_reads()
    engine.drain()
    if event == "reset":  # the reads' bytes were not used: "d" computed its prompt
        fills = [t for t in engine.runner.transfers if t is not None and t.fill_host_slots]
        assert not fills
        assert engine.manager.stats().kv_tiers[1].hits_tokens == 0
