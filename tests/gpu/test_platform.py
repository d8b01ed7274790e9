from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

import gpu.platform as platform_module
from gpu.platform import PlatformError, is_wsl_kernel_release, probe_platform
from kernels._triton import HAS_TRITON

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_cpu_platform_has_no_gpu_only_capabilities() -> None:
    platform = probe_platform("cpu")
    assert platform.device_type == "cpu" and platform.device == "cpu" and not platform.is_cuda
    assert platform.compute_capability is None
    assert not platform.has_triton, "Triton kernels only run on a GPU; the CPU path uses references"
    assert not platform.pin_memory_available and not platform.uva_available
    assert platform.total_memory_bytes >= platform.free_memory_bytes > 0
    assert platform.device_name


def test_without_proc_the_probe_reads_the_kernel_release_and_free_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where /proc cannot be read, WSL is told from uname and available memory from the
    free page count."""

    def no_proc(path: str, *args: object, **kwargs: object) -> None:
        raise PermissionError(path)

    monkeypatch.setattr(platform_module, "open", no_proc, raising=False)
    uname = SimpleNamespace(
        release="5.15.153.1-microsoft-standard-WSL2", processor="x86_64", machine="x86_64"
    )
    monkeypatch.setattr(platform_module.py_platform, "uname", lambda: uname)
    free_pages, sysconf = 1234, os.sysconf
    monkeypatch.setattr(
        platform_module.os,
        "sysconf",
        lambda name: free_pages if name == "SC_AVPHYS_PAGES" else sysconf(name),
    )
    platform = probe_platform("cpu")
    assert platform.is_wsl
    page = sysconf("SC_PAGE_SIZE")
    assert platform.free_memory_bytes == free_pages * page
    assert platform.total_memory_bytes == sysconf("SC_PHYS_PAGES") * page


def test_pinned_memory_that_fails_to_allocate_is_reported_off(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_pinned_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("no CUDA driver to pin memory with")

    monkeypatch.setattr(platform_module.torch, "empty", no_pinned_memory)
    with caplog.at_level(logging.WARNING, logger=platform_module.__name__):
        assert platform_module._probe_pin_memory(is_wsl=False, force=False) is False
    assert "pinned host memory is not available: no CUDA driver" in caplog.text


@no_cuda
def test_auto_falls_back_to_cpu_and_cuda_request_fails_without_a_gpu() -> None:
    assert probe_platform("auto").device_type == "cpu"
    with pytest.raises(PlatformError, match="CUDA is not available"):
        probe_platform("cuda:0")


@pytest.mark.parametrize("device", ["tpu", "cpu:1", "", "cuda:x", "gpu"])
def test_bad_device_strings_are_rejected(device: str) -> None:
    with pytest.raises(PlatformError, match="device must be"):
        probe_platform(device)


@pytest.mark.parametrize(
    ("release", "expected"),
    [
        ("5.15.153.1-microsoft-standard-WSL2", True),
        ("4.4.0-19041-Microsoft", True),  # WSL1
        ("6.8.0-45-generic", False),
        ("5.14.0-427.el9.x86_64", False),
    ],
)
def test_wsl_detection_from_kernel_release(release: str, expected: bool) -> None:
    assert is_wsl_kernel_release(release) is expected


def test_wsl_is_reported_and_pinned_memory_stays_off_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform_module, "detect_wsl", lambda: True)
    platform = probe_platform("cpu")
    assert platform.is_wsl and not platform.pin_memory_available


def test_pin_memory_probe_is_off_on_wsl_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = []

    def fake_empty(*args, **kwargs):
        attempts.append(kwargs)
        return torch.zeros(1)  # an unpinned tensor: the probe must report False

    monkeypatch.setattr(platform_module.torch, "empty", fake_empty)
    assert platform_module._probe_pin_memory(is_wsl=True, force=False) is False
    assert attempts == [], "on WSL2 pinned memory must not even be tried unless forced"
    assert platform_module._probe_pin_memory(is_wsl=True, force=True) is False
    assert attempts == [{"pin_memory": True}]


@no_cuda
def test_pin_memory_probe_reports_false_without_an_accelerator() -> None:
    assert platform_module._probe_pin_memory(is_wsl=False, force=False) is False


@pytest.mark.gpu
@needs_cuda
def test_cuda_platform_probe() -> None:
    platform = probe_platform("cuda")
    assert platform.device_type == "cuda" and platform.device.startswith("cuda:")
    assert platform.compute_capability is not None and platform.compute_capability[0] >= 3
    assert platform.total_memory_bytes >= platform.free_memory_bytes > 0
    assert platform.has_triton is HAS_TRITON
    if not platform.is_wsl:
        assert platform.pin_memory_available
        assert platform.uva_available is HAS_TRITON
    assert probe_platform("auto").device == platform.device


@pytest.mark.gpu
@needs_cuda
def test_cuda_platform_on_wsl_needs_force_for_pinned_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform_module, "detect_wsl", lambda: True)
    monkeypatch.delenv(platform_module.FORCE_PIN_MEMORY_ENV, raising=False)
    unforced = probe_platform("cuda")
    assert unforced.is_wsl and not unforced.pin_memory_available and not unforced.uva_available
    monkeypatch.setenv(platform_module.FORCE_PIN_MEMORY_ENV, "1")
    assert probe_platform("cuda").pin_memory_available
