"""Compile Triton kernels for an NVIDIA GPU on a machine without one (the nvidia backend and
its ptxas ship with the triton wheel), and report each kernel's registers, spills and
shared memory: catches compile errors and register blow-ups before device time is spent.

    python benchmarks/compile_check.py [--arch 90] [NAME ...]

Each entry of CHECKS launches one kernel through its launcher on CPU tensors with a fake
driver that compiles (warm-up) instead of launching. The versions of triton here and on the
device may differ; a kernel that compiles here can still fail there (and vice versa).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)


class _CompileOnlyDriver:
    """Just enough of triton's active driver to compile (never launch) for `arch`."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget("cuda", arch, 32)
        self.compiled: list[tuple[str, object]] = []

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int = 0) -> int:
        return 0

    def get_current_target(self):
        return self._target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_interface(self):
        import torch

        return torch.cuda

    def get_benchmarker(self):
        raise RuntimeError("compile only")


def _install(arch: int) -> _CompileOnlyDriver:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    fake = _CompileOnlyDriver(arch)
    driver.set_active(fake)
    original_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # compile, report, never launch
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        fake.compiled.append((self.__name__, kernel))
        return kernel

    JITFunction.run = run
    return fake


def _resource_usage(cubin: bytes) -> str:
    """REG / STACK / SHARED / LOCAL as cuobjdump reports them for the cubin."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        out = subprocess.run([str(tool), "-res-usage", handle.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return "REG {} STACK {} SHARED {} LOCAL {}".format(*found.groups()) if found else out.strip()[:200]


def _report(name: str, kernel: object) -> str:
    meta = kernel.metadata
    return f"{name:44} warps {meta.num_warps:2}  {_resource_usage(kernel.asm['cubin'])}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    fake = _install(args.arch)
    from compile_checks import CHECKS  # noqa: E402 - after the driver is installed

    failures = 0
    for name, check in CHECKS.items():
        if args.names and name not in args.names:
            continue
        fake.compiled.clear()
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - report every kernel
            failures += 1
            print(f"{name:36} FAILED: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        for kernel_name, kernel in fake.compiled:
            print(_report(f"{name}:{kernel_name}", kernel))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
