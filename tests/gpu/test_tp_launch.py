"""TP worker processes: results come back, a failing or hung rank is reported within its
deadline (never a hang), and no worker outlives its parent."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from gpu.distributed.env import apply_worker_env
from gpu.distributed.group import file_rendezvous
from gpu.distributed.launch import RankFailedError, start_workers
from tests.gpu._tp_lifecycle import engine_stand_in, sleep_rank
from tests.gpu._tp_workers import failing_rank


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_apply_worker_env_turns_multicast_off_and_says_what_it_overrode() -> None:
    environ = {"NCCL_NVLS_ENABLE": "1", "NVSHMEM_DISABLE_NVLS": "1", "OTHER": "x"}
    overridden = apply_worker_env(environ)
    assert overridden == {"NCCL_NVLS_ENABLE": "1"}
    assert environ == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "OTHER": "x",
    }


def test_results_come_back_in_rank_order() -> None:
    with start_workers(sleep_rank, 3, (0.0,)) as workers:
        assert workers.wait(60) == [0, 1, 2]
    with start_workers(sleep_rank, 3, (0.0,), first_rank=1) as workers:  # rank 0 stays here
        assert workers.wait(60) == [1, 2]


@pytest.mark.parametrize(("mode", "group_timeout_s"), [("raise", 30.0), ("hang", 3.0)])
def test_a_failing_or_hung_rank_fails_the_group_within_its_deadline(
    tmp_path, mode, group_timeout_s
) -> None:
    started = time.monotonic()
    args = (2, file_rendezvous(str(tmp_path)), mode, group_timeout_s)
    with start_workers(failing_rank, 2, args) as workers:
        with pytest.raises(RankFailedError) as failed:
            workers.wait(90)
    assert time.monotonic() - started < 60
    assert not any(process.is_alive() for process in workers.processes)
    if mode == "raise":  # its own error is reported, not only its peer's broken all-reduce
        assert "ValueError: rank 1 gives up" in failed.value.details[1]
    else:  # rank 0 gave up on its all-reduce after the group timeout; rank 1 was stopped
        assert list(failed.value.failures) == [0]


def test_ranks_past_the_deadline_are_stopped_and_reported() -> None:
    started = time.monotonic()
    with start_workers(sleep_rank, 2, (3600.0,)) as workers:
        with pytest.raises(RankFailedError, match="did not finish within 2 s") as failed:
            workers.wait(2)
    assert failed.value.failures.keys() == {0, 1}
    assert time.monotonic() - started < 30
    assert not any(process.is_alive() for process in workers.processes)


def test_check_alive_reports_a_rank_that_exited() -> None:
    with start_workers(sleep_rank, 2, (0.0,)) as workers:
        workers.processes[0].join(30)
        with pytest.raises(RankFailedError, match="rank 0 exited unexpectedly"):
            workers.check_alive()


def test_workers_exit_when_their_parent_is_killed() -> None:
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    parent = context.Process(target=engine_stand_in, args=(sender,))
    parent.start()
    try:
        assert receiver.poll(60), "the stand-in engine did not start its workers"
        worker_pids = receiver.recv()
        assert not any(_is_gone(pid) for pid in worker_pids)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.join(10)
    deadline = time.monotonic() + 20
    while not all(_is_gone(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_is_gone(pid) for pid in worker_pids)
