"""The event loop every process of `tandem serve` runs on: asyncio through anyio, on uvloop
when it is installed (a faster loop for a server that moves many small messages)."""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    if importlib.util.find_spec("uvloop") is None:
        return anyio.run(fn, *args)
    return anyio.run(fn, *args, backend_options={"use_uvloop": True})
