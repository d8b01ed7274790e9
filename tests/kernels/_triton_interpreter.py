"""Run kernel checks under Triton's CPU interpreter in a fresh Python process, plus the
markers and test factory that the kernel test files share.

Triton picks interpreted or compiled mode when a function is decorated with
`@triton.jit`, which for its own library functions (`tl.zeros`, `tl.sum`, ...) happens
when triton is first imported. Inside a pytest session other modules have usually
imported triton already, so `TRITON_INTERPRET=1` is set in a child process instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
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
    TRITON_INTERPRET=1; returns its stdout. `kwargs` must be Python literals."""
    test_dir = str(Path(test_file).resolve().parent)
    code = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(REPO_ROOT)!r}, {test_dir!r}]\n"
        f"runpy.run_path({str(Path(test_file).resolve())!r}, run_name='interpreted')"
        f"[{function_name!r}](**{kwargs or {}!r})\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, f"interpreted check failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


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
