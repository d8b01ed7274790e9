"""Actor base: one mailbox, one task, state owned by the actor alone.

`tell` posts a message and returns at once; `ask` posts a message and waits for the
handler's return value. Messages are handled strictly in arrival order, one at a time, so
an actor never needs a lock for its own state. An actor takes the messages of one union
(`Actor[ToAdmission]`, ...), all in actors/protocol/messages.py, and its `handle`
dispatches them with `match`, ending in `assert_never`: a type checker then finds a
message it forgot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from telemetry.logging import bind_actor

M = TypeVar("M")


class ActorStopped(RuntimeError):
    """The actor's mailbox is closed; it takes no more messages."""


@dataclass(slots=True)
class _Reply:
    done: anyio.Event = field(default_factory=anyio.Event)
    value: object = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class _Ask(Generic[M]):
    message: M
    reply: _Reply


class Actor(Generic[M]):
    """Subclasses implement `handle(message)`; `run()` is started in a task group."""

    name: str = "actor"

    def __init__(self) -> None:
        self._send: MemoryObjectSendStream[M | _Ask[M]]
        self._recv: MemoryObjectReceiveStream[M | _Ask[M]]
        # Unbounded: senders are other actors on the same loop and must never block on a
        # peer (two actors waiting on each other's full mailbox would deadlock). Admission
        # bounds the work that enters the system instead.
        self._send, self._recv = anyio.create_memory_object_stream(math.inf)

    def tell(self, message: M) -> None:
        self._post(message)

    async def ask(self, message: M) -> object:
        """The handler's answer to `message` (its exception is raised here)."""
        reply = _Reply()
        self._post(_Ask(message, reply))
        await reply.done.wait()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def close(self) -> None:
        """Stop taking messages; `run` returns after handling what is already queued."""
        self._send.close()
        self._notify()

    async def run(self) -> None:
        bind_actor(self.name)  # every line this task logs names the actor
        async with self._recv:
            async for message in self._recv:
                await self._dispatch(message)
                await self._drain_ready()
                await self.on_idle()
        await self.on_stop()

    def _post(self, message: M | _Ask[M]) -> None:
        try:
            self._send.send_nowait(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise ActorStopped(f"{self.name} is stopped") from exc
        self._notify()

    def _notify(self) -> None:
        """A message was posted or the mailbox closed: for an actor whose `run` waits on
        more than its mailbox (the engine loop also waits for steps)."""

    async def _drain_ready(self) -> bool:
        """Handle everything already queued (a burst of arrivals is acted on as one batch
        rather than one by one); False once the mailbox is closed and empty."""
        while True:
            try:
                message = self._recv.receive_nowait()
            except anyio.WouldBlock:
                return True
            except anyio.EndOfStream:
                return False
            await self._dispatch(message)

    async def _dispatch(self, message: M | _Ask[M]) -> None:
        if isinstance(message, _Ask):
            try:
                message.reply.value = await self.handle(message.message)
            except Exception as exc:  # the asker gets the error; the actor keeps running
                message.reply.error = exc
            message.reply.done.set()
            return
        await self.handle(message)

    async def handle(self, message: M) -> object:
        raise NotImplementedError

    async def on_idle(self) -> None:
        """Called whenever the mailbox has just been emptied."""

    async def on_stop(self) -> None:
        """Called once the mailbox is drained after `close()`."""
