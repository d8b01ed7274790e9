"""Run kernel checks under Triton's CPU interpreter in a fresh Python process.

Triton picks interpreted or compiled mode when a function is decorated with
`@triton.jit`, which for its own library functions (`tl.zeros`, `tl.sum`, ...) happens
when triton is first imported. Inside a pytest session other modules have usually
imported triton already, so `TRITON_INTERPRET=1` is set in a child process instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_in_triton_interpreter(test_file: str, function_name: str, timeout_s: float = 300) -> None:
    """Call `function_name()` from `test_file` in a child process with TRITON_INTERPRET=1."""
    test_dir = str(Path(test_file).resolve().parent)
    code = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(REPO_ROOT)!r}, {test_dir!r}]\n"
        f"runpy.run_path({str(Path(test_file).resolve())!r}, run_name='interpreted')[{function_name!r}]()\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, f"interpreted check failed:\n{result.stdout}\n{result.stderr}"
