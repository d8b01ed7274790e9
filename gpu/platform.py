"""What the machine offers the runners, probed once at startup.

Runner selection (gpu/runner_selection.py) reads only this record, so the rules can be
tested with hand-made Platform values on any machine.
"""

from __future__ import annotations

import logging
import os
import platform as py_platform
import re
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

FORCE_PIN_MEMORY_ENV = "TANDEM_FORCE_PIN_MEMORY"
"""Set to 1 to use pinned memory on WSL2, where it is off by default."""


class PlatformError(ValueError):
    """The requested device does not exist or cannot be used."""


@dataclass(frozen=True, slots=True)
class Platform:
    device_type: str
    """'cuda' or 'cpu'."""
    device: str
    """The torch device string the runner uses ('cuda:0', 'cpu')."""
    device_name: str
    compute_capability: tuple[int, int] | None
    """(major, minor) on CUDA, None on CPU."""
    total_memory_bytes: int
    free_memory_bytes: int
    has_triton: bool
    """Triton imports and a trivial kernel ran on the device. Always False on CPU, where
    the torch references run instead."""
    pin_memory_available: bool
    """Page-locked host memory works (CUDA only; off on WSL2 unless forced)."""
    uva_available: bool
    """The GPU can read pinned host memory through unified virtual addressing."""
    is_wsl: bool

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"


def probe_platform(device: str = "auto", *, force_pin_memory: bool | None = None) -> Platform:
    """Probe the device once at startup: 'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:N'.

    force_pin_memory=None reads TANDEM_FORCE_PIN_MEMORY; True enables pinned memory on WSL2.
    """
    device_type, index = _resolve_device(device)
    is_wsl = detect_wsl()
    if device_type == "cpu":
        total, free = _host_memory_bytes()
        return Platform(
            device_type="cpu",
            device="cpu",
            device_name=py_platform.processor() or py_platform.machine(),
            compute_capability=None,
            total_memory_bytes=total,
            free_memory_bytes=free,
            has_triton=False,
            pin_memory_available=False,
            uva_available=False,
            is_wsl=is_wsl,
        )
    if force_pin_memory is None:
        force_pin_memory = os.environ.get(FORCE_PIN_MEMORY_ENV, "0").strip() == "1"
    torch_device = torch.device("cuda", index)
    properties = torch.cuda.get_device_properties(torch_device)
    free, total = torch.cuda.mem_get_info(torch_device)
    has_triton = _probe_triton(torch_device)
    pin_memory = _probe_pin_memory(is_wsl, force_pin_memory)
    return Platform(
        device_type="cuda",
        device=str(torch_device),
        device_name=properties.name,
        compute_capability=(properties.major, properties.minor),
        total_memory_bytes=int(total),
        free_memory_bytes=int(free),
        has_triton=has_triton,
        pin_memory_available=pin_memory,
        uva_available=pin_memory and has_triton and _probe_uva(torch_device),
        is_wsl=is_wsl,
    )


def _resolve_device(device: str) -> tuple[str, int]:
    match = re.fullmatch(r"(auto|cpu|cuda)(?::(\d+))?", device.strip().lower())
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise PlatformError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    kind = match.group(1)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return "cpu", 0
    if not torch.cuda.is_available():
        raise PlatformError(f"device {device!r} was requested but CUDA is not available")
    index = int(match.group(2) or torch.cuda.current_device())
    if index >= torch.cuda.device_count():
        raise PlatformError(
            f"device {device!r} does not exist ({torch.cuda.device_count()} CUDA devices)"
        )
    return "cuda", index


def is_wsl_kernel_release(release: str) -> bool:
    """WSL kernels name themselves in their release string ('5.15.90.1-microsoft-standard-WSL2')."""
    return "microsoft" in release.lower() or "wsl" in release.lower()


def detect_wsl() -> bool:
    try:
        with open("/proc/sys/kernel/osrelease", encoding="utf-8") as f:
            release = f.read()
    except OSError:
        release = py_platform.uname().release
    return is_wsl_kernel_release(release)


def _host_memory_bytes() -> tuple[int, int]:
    """(total, available) host memory; available falls back to free pages without /proc."""
    page_size = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page_size
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, os.sysconf("SC_AVPHYS_PAGES") * page_size


def _probe_triton(device: torch.device) -> bool:
    """Triton is usable when it imports and a one-element kernel gives the right answer."""
    try:
        from kernels.staged_write import staged_write_triton

        target = torch.zeros(1, 4, dtype=torch.int32, device=device)
        index = torch.tensor([0, 1, 0, 2], dtype=torch.int64, device=device)
        staged_write_triton(
            target,
            index[0:1],
            index[1:2],
            index[2:4],
            torch.tensor([7, 9], dtype=torch.int32, device=device),
        )
        return target.tolist() == [[0, 7, 9, 0]]
    except Exception as err:  # noqa: BLE001 - any failure means Triton is unusable here
        logger.warning("Triton is not usable on %s: %s", device, err)
        return False


def _probe_pin_memory(is_wsl: bool, force: bool) -> bool:
    if is_wsl and not force:
        # WSL2 caps pinned memory far below what the runner's buffers need.
        return False
    try:
        return bool(torch.empty(16, pin_memory=True).is_pinned())
    except RuntimeError as err:
        logger.warning("pinned host memory is not available: %s", err)
        return False


def _probe_uva(device: torch.device) -> bool:
    """The device reads a pinned host tensor in place, as the runner does with a token
    history kept in pinned host memory."""
    try:
        from kernels.prepare_inputs import prepare_inputs_triton

        history_cpu = torch.tensor([[5, 6, 7]], dtype=torch.int32).pin_memory()
        step_inputs = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(2)]
        seq_lens = torch.zeros(1, dtype=torch.int32, device=device)
        prepare_inputs_triton(
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.tensor([0, 2], dtype=torch.int32, device=device),
            history_cpu,
            torch.tensor([1], dtype=torch.int32, device=device),
            *step_inputs,
            seq_lens,
            num_reqs=1,
            num_tokens=2,
        )
        return step_inputs[0].tolist() == [6, 7]
    except Exception as err:  # noqa: BLE001 - any failure means no UVA reads
        logger.warning("the GPU cannot read pinned host memory through UVA: %s", err)
        return False
