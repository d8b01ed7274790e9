"""Run kernel checks under Triton's CPU interpreter in child Python processes, plus the
markers and test factories that the kernel test files share.

Triton picks interpreted or compiled mode when a function is decorated with
`@triton.jit`, which for its own library functions (`tl.zeros`, `tl.sum`, ...) happens
when triton is first imported. Inside a pytest session other modules have usually
imported triton already, so `TRITON_INTERPRET=1` is set in a child process instead.

An interpreted check is one core running Python for seconds while pytest waits. Two
children serve the session's checks (starting one per check cost more than most checks),
and when a test asks for its check, the checks of the next interpreted tests that the
session runs in the same folder are queued behind it (LOOKAHEAD of them), so that both
children keep working while pytest waits or runs the tests in between: tests made by
`interpreted_test` or `triton_vs_reference_tests` say which check they run, and
tests/conftest.py hands their order to `plan_interpreted_checks` once the session has
collected them.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from kernels._triton import HAS_TRITON

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_CHILDREN = 2
"""The CI machine's cores."""
LOOKAHEAD = 8
"""Planned checks started ahead of the tests that ask for them, at most (queued behind the
running ones: both children stay busy while pytest runs the tests in between)."""

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")


ON_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
"""The marks of a GPU-only test (`gpu`, skipped without CUDA), for one parameter too."""


def cuda_test(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a GPU-only test: `gpu`, and skipped without CUDA."""
    for mark in reversed(ON_CUDA):
        test = mark(test)
    return test


def run_in_triton_interpreter(
    test_file: str,
    function_name: str,
    timeout_s: float = 300,
    kwargs: dict[str, Any] | None = None,
) -> str:
    """Call `function_name(**kwargs)` from `test_file` in a child process with
    TRITON_INTERPRET=1; returns what it printed. `kwargs` must be Python literals.

    Each check runs its file afresh (`runpy.run_path`) with torch's global RNG reset to a
    fresh process's state, and a child whose check failed, crashed or timed out is
    replaced before its next check."""
    check = _Check(str(Path(test_file).resolve()), function_name, repr(kwargs or {}))
    reply, stderr = _checks.result(check, timeout_s)
    if reply is None or not reply["ok"]:
        what = "failed" if reply else "crashed or timed out"
        printed, error = (reply["stdout"], reply["error"]) if reply else ("", "")
        raise AssertionError(f"interpreted check {what}:\n{printed}\n{stderr}\n{error}")
    return str(reply["stdout"])


def interpreted_test(
    test_file: str,
    function_name: str,
    *,
    kwargs: dict[str, Any] | None = None,
    printed: str | None = None,
) -> Callable[[], None]:
    """A test that runs `function_name(**kwargs)` from `test_file` in the interpreter and,
    with `printed`, checks that it printed that. Assign it to a `test_*` name."""

    @needs_triton
    def in_interpreter() -> None:
        stdout = run_in_triton_interpreter(test_file, function_name, kwargs=kwargs)
        if printed is not None:
            assert printed in stdout, stdout

    setattr(in_interpreter, PLANNED_CHECK, (test_file, function_name, kwargs))
    return in_interpreter


PLANNED_CHECK = "interpreted_check"
"""The attribute of a test function that names its check: (file, function, kwargs)."""
PLANNED_TIMEOUT_S = 300.0
"""run_in_triton_interpreter's default."""


def cancel_planned_checks() -> None:
    """Drops the planned checks not started yet (at the session's end: a run stopped
    early, by -x or a keyboard interrupt, waits for no more than the running ones)."""
    _checks.cancel_queued()


def plan_interpreted_checks(test_functions: Sequence[object]) -> None:
    """The session's test functions in the order they run; those carrying PLANNED_CHECK
    become the plan that checks are started ahead from."""
    planned = [getattr(test, PLANNED_CHECK, None) for test in test_functions]
    _checks.plan = [
        _Check(str(Path(file).resolve()), function, repr(kwargs or {}))
        for file, function, kwargs in filter(None, planned)
    ]


class _Check(NamedTuple):
    file: str
    """Resolved."""
    function: str
    kwargs: str
    """Their repr."""


_Outcome = tuple[dict[str, Any] | None, str]
"""A check's reply (None if its child crashed or timed out) and, when it did not pass,
what its child wrote to stderr meanwhile."""


class _Checks:
    """Checks run by NUM_CHILDREN threads, each with a child of its own; a check asked for
    takes the run started ahead for it, if any, and starts the planned ones after it."""

    def __init__(self) -> None:
        self.plan: list[_Check] = []
        self._next_planned = 0
        self._started: dict[_Check, list[Future[_Outcome]]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(NUM_CHILDREN, thread_name_prefix="triton-interpreter")
        self._local = threading.local()
        self.children: list[_Child] = []

    def result(self, check: _Check, timeout_s: float) -> _Outcome:
        with self._lock:
            started = self._started.get(check)
            if started:
                future = started.pop(0)
            else:  # not started ahead: the session left the plan, or has none
                future = self._pool.submit(self._run, check, timeout_s)
                self._skip_plan_to(check)
            self._start_ahead(Path(check.file).parent)
        return future.result()

    def cancel_queued(self) -> None:
        with self._lock:
            self._next_planned = len(self.plan)
            for futures in self._started.values():
                for future in futures:
                    future.cancel()  # False for a running check, which ends on its own

    def _skip_plan_to(self, check: _Check) -> None:
        """Past `check` in the plan, if it is still ahead there."""
        ahead = self.plan[self._next_planned :]
        if check in ahead:
            self._next_planned += ahead.index(check) + 1

    def _start_ahead(self, folder: Path) -> None:
        """Up to LOOKAHEAD planned checks at once, of tests in `folder` (the other folders'
        tests may measure time, with no check running beside them)."""
        running = sum(not f.done() for futures in self._started.values() for f in futures)
        while running < LOOKAHEAD and self._next_planned < len(self.plan):
            check = self.plan[self._next_planned]
            if Path(check.file).parent != folder:
                break
            self._next_planned += 1
            future = self._pool.submit(self._run, check, PLANNED_TIMEOUT_S)
            self._started.setdefault(check, []).append(future)
            running += 1

    def _run(self, check: _Check, timeout_s: float) -> _Outcome:
        """In a pool thread: the check in this thread's child (replaced after a failure)."""
        child: _Child | None = getattr(self._local, "child", None)
        if child is None or child.proc.poll() is not None:
            child = self._local.child = _Child()
            with self._lock:
                self.children.append(child)
        stderr_start = os.fstat(child.stderr.fileno()).st_size
        try:
            reply = child.call(check._asdict(), timeout_s)
        except BaseException:
            child.stop()
            raise
        if reply is not None and reply["ok"]:
            return reply, ""
        return reply, child.stop(stderr_from=stderr_start)


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


_checks = _Checks()


@atexit.register
def _stop_the_children_at_exit() -> None:
    for child in _checks.children:
        if child.proc.poll() is None:  # the others were stopped when their check failed
            child.stop()


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
    in_interpreter = interpreted_test(
        compare.__code__.co_filename, compare.__name__, kwargs=interpreted
    )

    @cuda_test
    def on_gpu() -> None:
        compare(**on_cuda)

    return in_interpreter, on_gpu
