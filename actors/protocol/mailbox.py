"""Actor base: one mailbox, one task, state owned by the actor alone.

`tell` posts a message and returns at once; `ask` posts a message and waits for the
handler's return value. Messages are handled strictly in arrival order, one at a time, so
an actor never needs a lock for its own state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from telemetry.logging import bind_actor

T = TypeVar("T")


class ActorStopped(RuntimeError):
    """The actor's mailbox is closed; it takes no more messages."""


@dataclass(slots=True)
class _Reply(Generic[T]):
    done: anyio.Event = field(default_factory=anyio.Event)
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class _Ask:
    message: Any
    reply: _Reply[Any]


class Actor:
    """Subclasses implement `handle(message)`; `run()` is started in a task group."""

    name: str = "actor"

    def __init__(self) -> None:
        self._send: MemoryObjectSendStream[Any]
        self._recv: MemoryObjectReceiveStream[Any]
        # Unbounded: senders are other actors on the same loop and must never block on a
        # peer (two actors waiting on each other's full mailbox would deadlock). Admission
        # bounds the work that enters the system instead.
        self._send, self._recv = anyio.create_memory_object_stream(math.inf)

    def tell(self, message: Any) -> None:
        try:
            self._send.send_nowait(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise ActorStopped(f"{self.name} is stopped") from exc

    async def ask(self, message: Any) -> Any:
        reply: _Reply[Any] = _Reply()
        self.tell(_Ask(message, reply))
        await reply.done.wait()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def close(self) -> None:
        """Stop taking messages; `run` returns after handling what is already queued."""
        self._send.close()

    async def run(self) -> None:
        bind_actor(self.name)  # every line this task logs names the actor
        async with self._recv:
            async for message in self._recv:
                await self._dispatch(message)
                await self._drain_ready()
                await self.on_idle()
        await self.on_stop()

    async def _drain_ready(self) -> None:
        # Handle everything already queued before `on_idle`, so a burst of messages (many
        # arrivals at once) is acted on as one batch rather than one by one.
        while True:
            try:
                message = self._recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                return
            await self._dispatch(message)

    async def _dispatch(self, message: Any) -> None:
        if isinstance(message, _Ask):
            try:
                message.reply.value = await self.handle(message.message)
            except Exception as exc:  # the asker gets the error; the actor keeps running
                message.reply.error = exc
            message.reply.done.set()
            return
        await self.handle(message)

    async def handle(self, message: Any) -> Any:
        raise NotImplementedError

    async def on_idle(self) -> None:
        """Called whenever the mailbox has just been emptied."""

    async def on_stop(self) -> None:
        """Called once the mailbox is drained after `close()`."""
