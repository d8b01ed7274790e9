"""Light worker functions for the launcher tests (no torch import, so they start fast)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

from gpu.distributed.launch import start_workers


def sleep_rank(rank: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def engine_stand_in(conn: Connection) -> None:
    """Starts two sleeping workers, reports their pids, then waits to be killed."""
    workers = start_workers(sleep_rank, 2, (3600.0,))
    conn.send(workers.pids)
    time.sleep(3600)
