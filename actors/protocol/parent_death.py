"""A child process of `tandem serve` dies with its parent, so that no engine core or API
server outlives the server that started it (even when the parent is SIGKILLed)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux)."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
