"""What every device benchmark of this folder records beside its numbers: commit, hardware,
software versions, the exact command and when it ran (results without them cannot be
compared). Kept free of tandem imports so that scripts can load it before they choose
which code tree to import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_record(benchmark: str, workload: dict[str, Any]) -> dict[str, Any]:
    import torch

    record: dict[str, Any] = {
        "benchmark": benchmark,
        "commit": os.environ.get("TANDEM_COMMIT") or git_commit(Path(__file__).parent),
        "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": workload,
    }
    try:
        import triton

        record["triton"] = str(triton.__version__)
    except ImportError:
        record["triton"] = None
    return record


def git_commit(directory: Path) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=directory).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
