"""Run kernel checks under Triton's CPU interpreter in a child Python process, plus the
markers and test factory that the kernel test files share.

Triton picks interpreted or compiled mode when a function is decorated with
`@triton.jit`, which for its own library functions (`tl.zeros`, `tl.sum`, ...) happens
when triton is first imported. Inside a pytest session other modules have usually
imported triton already, so `TRITON_INTERPRET=1` is set in a child process instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels._triton import HAS_TRITON

REPO_ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")


def cuda_test(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a GPU-only test: `gpu`, and skipped without CUDA."""
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(needs_cuda(test))


def run_in_triton_interpreter(
    test_file: str,
    function_name: str,
    timeout_s: float = 300,
    kwargs: dict[str, Any] | None = None,
) -> str:
    """Call `function_name(**kwargs)` from `test_file` in a child process with
    TRITON_INTERPRET=1; returns what it printed. `kwargs` must be Python literals.

    One child serves every check of the session (starting one per check cost more than
    most checks): each check runs its file afresh (`runpy.run_path`) with torch's global
    RNG reset to a fresh process's state, and a child whose check failed, crashed or
    timed out is replaced before the next check."""
    global _child
    child, _child = _child, None  # back only once this check has passed
    if child is None or child.proc.poll() is not None:
        child = _Child()
    request = {"file": str(Path(test_file).resolve()), "function": function_name}
    request["kwargs"] = repr(kwargs or {})
    stderr_start = os.fstat(child.stderr.fileno()).st_size
    try:
        reply = child.call(request, timeout_s)
    except BaseException:
        child.stop()
        raise
    if reply is None or not reply["ok"]:
        stderr = child.stop(stderr_from=stderr_start)
        what = "failed" if reply else "crashed or timed out"
        printed, error = (reply["stdout"], reply["error"]) if reply else ("", "")
        raise AssertionError(f"interpreted check {what}:\n{printed}\n{stderr}\n{error}")
    _child = child
    return str(reply["stdout"])


# What the child runs: requests as JSON lines on stdin, one reply line each on the stdout it
# started with; whatever the checks write to file descriptor 1 goes to stderr instead.
_CHILD_CODE = """
import ast, contextlib, io, json, os, runpy, sys, traceback
sys.path[:0] = [{repo_root!r}]
import torch
fresh_rng = torch.random.get_rng_state()
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    request = json.loads(line)
    test_dir = os.path.dirname(request["file"])
    if test_dir not in sys.path:
        sys.path.insert(1, test_dir)
    torch.random.set_rng_state(fresh_rng)
    printed = io.StringIO()
    reply = {{"ok": True, "error": ""}}
    try:
        with contextlib.redirect_stdout(printed):
            check = runpy.run_path(request["file"], run_name="interpreted")[request["function"]]
            check(**ast.literal_eval(request["kwargs"]))
    except BaseException:
        reply = {{"ok": False, "error": traceback.format_exc()}}
    reply["stdout"] = printed.getvalue()
    sys.stdout.flush()
    replies.write(json.dumps(reply) + "\\n")
    replies.flush()
"""


class _Child:
    """The TRITON_INTERPRET=1 process that runs the checks; its stderr goes to a file."""

    def __init__(self) -> None:
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_CODE.format(repo_root=str(REPO_ROOT))],
            cwd=REPO_ROOT,
            env={**os.environ, "TRITON_INTERPRET": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def call(self, request: dict[str, str], timeout_s: float) -> dict[str, Any] | None:
        """The reply to `request`, or None if the child died or did not answer in time."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def stop(self, stderr_from: int = 0) -> str:
        """Kill the child; returns what it wrote to stderr from offset `stderr_from` on."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        size = os.fstat(self.stderr.fileno()).st_size
        written = os.pread(self.stderr.fileno(), max(size - stderr_from, 0), stderr_from)
        self.stderr.close()
        return written.decode(errors="replace")


_child: _Child | None = None


@atexit.register
def _stop_the_child_at_exit() -> None:
    if _child is not None:
        _child.stop()


def assert_interpreted(*kernels: object) -> None:
    """Guards an interpreted check against silently running compiled kernels."""
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in kernels:
        assert isinstance(kernel, InterpretedFunction), "kernel is not interpreted"


def triton_vs_reference_tests(
    compare: Callable[..., None], *, interpreted: dict[str, Any], on_cuda: dict[str, Any]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The two tests of a module-level `compare(**case)` that runs the Triton launcher and
    the torch reference on one case and asserts they agree: once in the interpreter on
    the `interpreted` case, once on a GPU on the `on_cuda` case. Assign them to
    `test_*` names in the test module."""
    test_file, function_name = compare.__code__.co_filename, compare.__name__

    @needs_triton
    def in_interpreter() -> None:
        run_in_triton_interpreter(test_file, function_name, kwargs=interpreted)

    @cuda_test
    def on_gpu() -> None:
        compare(**on_cuda)

    return in_interpreter, on_gpu
