"""Checks a request's new structured-output spec in a process of its own before the
engine core sees it.

The grammar library compiles in native code: a spec can overflow its stack (a process
cannot catch that) or take minutes. So a front end keeps a few checker processes
(actors/core/grammar_worker.py), each compiling one spec at a time exactly as the engine core
will, and gives each compile a time budget: a checker that is past it, or that died, is
killed and replaced, and the spec is refused. A spec seen before is answered from a cache
of verdicts without a process. Specs that pass compile in the core on its compile threads,
off the step loop.

    checker = GrammarChecker(lambda: start, num_processes=2, timeout_s=10.0)
    error = await checker.check(spec)   # None, or why the spec cannot be served
    await checker.aclose()
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable

import anyio
import anyio.abc
import msgspec
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from actors.protocol.codec import FRAME_HEADER, frame
from actors.protocol.messages import GrammarCheck, GrammarCheckerStart, GrammarVerdict
from actors.protocol.structured_output import StructuredOutputSpec

log = structlog.get_logger("tandem.grammar_checker")

DEFAULT_NUM_PROCESSES = 2
DEFAULT_TIMEOUT_S = 10.0
VERDICT_CACHE_SIZE = 4096


STARTUP_TIMEOUT_S = 120.0
"""A new checker process must have loaded the tokenizer within this."""


class GrammarCheckerUnavailable(Exception):
    """No checker process could take the spec: all stayed busy for the time budget, or
    none could be started."""


class _Checker:
    """One checker process, compiling one spec at a time."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._stdout = BufferedByteReceiveStream(process.stdout)

    async def ask(self, payload: bytes) -> bytes:
        await self._stdin.send(frame(payload))
        (size,) = FRAME_HEADER.unpack(await self._stdout.receive_exactly(FRAME_HEADER.size))
        return await self._stdout.receive_exactly(size)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            await self.process.aclose()


_PROCESS_GONE = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)


class GrammarChecker:
    def __init__(
        self,
        start: Callable[[], GrammarCheckerStart],
        *,
        num_processes: int = DEFAULT_NUM_PROCESSES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """`start()`: what to compile against, asked (in a worker thread: serializing a
        large tokenizer takes a while) when the first process starts; `timeout_s`: the most
        one compile may take (and the longest a check waits for a free process)."""
        self._make_start = start
        self._start: bytes | None = None
        self.timeout_s = timeout_s
        self._slots = anyio.Semaphore(num_processes)
        self._idle: list[_Checker] = []
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(GrammarVerdict)

    async def check(self, spec: StructuredOutputSpec) -> str | None:
        """Why `spec` cannot be served (it does not compile, it is over a budget, its
        compile took longer than the time budget or crashed), or None. Raises
        GrammarCheckerUnavailable when no process could take it."""
        payload = self._encoder.encode(GrammarCheck(spec))
        key = hashlib.blake2b(payload, digest_size=16).digest()
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            return self._verdicts[key]
        acquired = False
        with anyio.move_on_after(self.timeout_s):
            await self._slots.acquire()
            acquired = True
        if not acquired:
            raise GrammarCheckerUnavailable(
                f"every grammar checker stayed busy for {self.timeout_s:g} s"
            )
        try:
            error, lasting = await self._compile(payload)
        finally:
            self._slots.release()
        if lasting:
            self._verdicts[key] = error
            if len(self._verdicts) > VERDICT_CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return error

    async def aclose(self) -> None:
        """Stop the idle processes (a busy one is stopped by the check that holds it)."""
        while self._idle:
            await self._idle.pop().aclose()

    async def _compile(self, payload: bytes) -> tuple[str | None, bool]:
        """(why the spec cannot be served or None, whether that verdict lasts: a compile
        cut short by the time budget may pass on a less busy machine)."""
        checker = self._idle.pop() if self._idle else await self._spawn()
        try:
            with anyio.fail_after(self.timeout_s):
                reply = await checker.ask(payload)
        except TimeoutError:
            await checker.aclose()
            return (
                f"compiling it took longer than the server's limit of {self.timeout_s:g} "
                "seconds (--grammar-compile-timeout)"
            ), False
        except _PROCESS_GONE:
            await checker.aclose()
            log.warning("grammar_checker_crashed", returncode=checker.process.returncode)
            return "it crashed the grammar compiler (too deep or too large)", True
        except BaseException:  # cancelled (the client left): the process is mid-compile
            await checker.aclose()
            raise
        self._idle.append(checker)
        return self._decoder.decode(reply).error, True

    async def _spawn(self) -> _Checker:
        if self._start is None:
            self._start = await anyio.to_thread.run_sync(
                lambda: msgspec.msgpack.encode(self._make_start())
            )
        try:
            process = await anyio.open_process(
                [sys.executable, "-m", "actors.core.grammar_worker", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,
            )
        except OSError as exc:
            raise GrammarCheckerUnavailable(f"cannot start a grammar checker: {exc}") from exc
        checker = _Checker(process)
        try:
            with anyio.fail_after(STARTUP_TIMEOUT_S):
                await checker.ask(self._start)  # answered once the tokenizer is loaded
        except (TimeoutError, *_PROCESS_GONE) as exc:
            await checker.aclose()
            raise GrammarCheckerUnavailable("a grammar checker did not start") from exc
        except BaseException:
            await checker.aclose()
            raise
        return checker
