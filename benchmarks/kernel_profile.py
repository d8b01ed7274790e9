"""Where a run's device time goes, kernel by kernel: one run under torch.profiler (CUDA
kernels, those a CUDA graph replays among them), each kernel name's device time and calls
per engine step, largest first. A batch-1 decode step is the sum of these rows, so the
table says which kernels keep it from its weight-read floor, and a kernel whose time per
call does not follow its bytes stands out."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

NAME_CHARS = 96
"""Kernel names are cut to this many characters (CUTLASS templates run to thousands)."""


def summarise_kernels(
    events: Iterable[tuple[str, float]], num_steps: int, top: int = 20
) -> dict[str, Any]:
    """`events`: (kernel name, device microseconds) per launch; the `top` names by device
    time, per step of the `num_steps` the run took, and the rest as one row."""
    device_us: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    for name, duration_us in events:
        short = name[:NAME_CHARS]
        device_us[short] += duration_us
        calls[short] += 1
    steps = max(num_steps, 1)
    total_us = sum(device_us.values())
    ranked = sorted(device_us, key=device_us.__getitem__, reverse=True)

    def row(name: str, us: float, count: int) -> dict[str, Any]:
        return {
            "name": name,
            "ms_per_step": us / 1e3 / steps,
            "calls_per_step": count / steps,
            "share": us / total_us if total_us else 0.0,
        }

    rows = [row(name, device_us[name], calls[name]) for name in ranked[:top]]
    rest = ranked[top:]
    if rest:
        rest_us = sum(device_us[name] for name in rest)
        rows.append(row(f"({len(rest)} other kernels)", rest_us, sum(calls[n] for n in rest)))
    return {
        "num_steps": num_steps,
        "num_kernel_launches": sum(calls.values()),
        "device_ms_per_step": total_us / 1e3 / steps,
        "kernels": rows,
    }


def profile_kernels(run: Callable[[], int], top: int = 20) -> dict[str, Any]:
    """Run `run` (it returns the number of engine steps it took) under torch.profiler and
    summarise its CUDA kernels."""
    import torch
    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        num_steps = run()
    events = (
        (event.name, float(event.time_range.elapsed_us()))
        for event in profiler.events()
        if event.device_type == DeviceType.CUDA
    )
    return summarise_kernels(events, num_steps, top)


def format_kernels(summary: dict[str, Any], lines: int = 12) -> str:
    """The summary's first `lines` rows as a table for the log."""
    out = [
        f"device time {summary['device_ms_per_step']:.3f} ms per step over "
        f"{summary['num_steps']} steps ({summary['num_kernel_launches']} kernels)"
    ]
    for row in summary["kernels"][:lines]:
        out.append(
            f"  {row['ms_per_step']:8.3f} ms {row['calls_per_step']:7.1f} calls "
            f"{100 * row['share']:5.1f}%  {row['name']}"
        )
    return "\n".join(out)
