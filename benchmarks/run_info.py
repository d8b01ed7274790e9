"""What a benchmark result records about where and how it ran: commit, hardware, command
line and the machine's load average (the benchmark machines are shared)."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str | None:
    """`git rev-parse HEAD` of the checkout, plus '-dirty' when tracked files differ."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10,
                                 check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if changed else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """CUDA devices visible to torch; empty without torch or without a GPU."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def hardware() -> dict[str, Any]:
    return {"cpu": cpu_model(), "num_cpus": os.cpu_count(), "gpus": gpu_names(),
            "platform": platform.platform(), "python": platform.python_version()}


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds that process `pid` (all its threads) has used so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        # Fields after the parenthesised command name; utime and stime are the 12th and 13th.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def command_line(program: str = "tandem") -> str:
    """The command as typed: `tandem ...` for the console script, `python -m ...` otherwise."""
    argv0 = Path(sys.argv[0]).name
    if argv0 == program:
        return shlex.join([program, *sys.argv[1:]])
    if argv0 == "__main__.py" or sys.argv[0].endswith(".py"):
        module = sys.modules["__main__"].__spec__
        if module is not None:
            return shlex.join(["python", "-m", module.name.removesuffix(".__main__"),
                               *sys.argv[1:]])
    return shlex.join(sys.argv)


def run_header(command: str) -> dict[str, Any]:
    return {"commit": git_commit(), "hardware": hardware(), "command": command,
            "load_average_before": load_average()}
