"""Triton import shim: kernel modules import `triton`/`tl` from here so that they load on
machines without Triton, where only the torch references run."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: the torch references are used instead
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False
