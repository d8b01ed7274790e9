"""GPU actors: the runner's loop in dedicated threads, off the event loop.

Two actors, one per runner, swapped at startup rather than branched inside one loop:

- `GPUActorV2` overlaps: a launcher thread enqueues step N+1 while a completion thread
  waits for step N's event and posts its result, so the device never waits for Python.
- `GPUActorV1` is the fallback: one thread that runs a step, waits for its tokens, posts.

Results go back to the event loop with `call_soon_threadsafe`, never blocking the threads.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import numpy as np
import structlog

from actors.protocol.messages import SchedulerOutput, StepOutput, StepStats
from telemetry.logging import bind_actor

log = structlog.get_logger("tandem.gpu_actor")
_STOP = object()
MAX_RECENT_STEP_STATS = 100_000
"""Steps whose stats `recent_step_stats` keeps (benchmarks read them after a run)."""


class _GPUActorBase:
    name = "gpu"

    def __init__(self, runner: Any, on_step_output: Callable[[StepOutput], None]) -> None:
        self.runner = runner
        self._on_step_output = on_step_output
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.recent_step_stats: collections.deque[StepStats] = collections.deque(
            maxlen=MAX_RECENT_STEP_STATS)
        self._rows_to_free: frozenset[str] = frozenset()
        """Finished requests a failed step may not have freed (launcher thread only)."""
        self._thread_ended = threading.Event()

    def submit(self, sched: SchedulerOutput) -> None:
        self._inbox.put(sched)

    def close(self) -> None:
        self._inbox.put(_STOP)
        deferred = getattr(self.runner, "deferred_masks", None)
        if deferred is not None:  # a step waiting for its grammar mask fails, not hangs
            deferred.close()

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        bind_actor(self.name)  # anyio copies this task's context into the worker thread
        try:
            await anyio.to_thread.run_sync(self._thread_body, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            # Cancelled (another actor of the engine died): stop the thread, which would
            # otherwise wait for steps forever and keep the engine from ending, and let it
            # finish the step it may be running before the runner is closed.
            self.close()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._thread_ended.wait)
            raise
        finally:
            close = getattr(self.runner, "close", None)  # the V2 runner hands its state back
            if close is not None:
                close()

    def _thread_body(self) -> None:
        try:
            self._thread_main()
        finally:
            self._thread_ended.set()

    def _post(self, out: StepOutput) -> None:
        assert self._loop is not None
        self.recent_step_stats.append(out.stats)
        self._loop.call_soon_threadsafe(self._on_step_output, out)

    def _execute(self, sched: SchedulerOutput) -> Any:
        """`runner.execute`, or a failed StepOutput when it raises. A step can fail before
        the runner freed the rows it was told to free, and nothing would name those
        finished requests again: they are freed with the next step (freeing is
        idempotent). The step's own requests are named again once they fail."""
        if self._rows_to_free:
            sched = msgspec.structs.replace(
                sched, finished_request_ids=sched.finished_request_ids | self._rows_to_free)
            self._rows_to_free = frozenset()
        try:
            return self.runner.execute(sched)
        except Exception as exc:  # noqa: BLE001 - a failed step must not kill the engine
            re_added = {new.request_id for new in sched.new_requests}
            self._rows_to_free = sched.finished_request_ids - re_added
            return failed_step(sched.step_id, sched.scheduled_request_ids, exc)

    def _thread_main(self) -> None:
        raise NotImplementedError


def failed_step(step_id: int, request_ids: tuple[str, ...], exc: BaseException) -> StepOutput:
    """A step that raised: every request in it fails; the engine keeps serving the rest. The
    error its requests end with reaches their clients, so it names no internals (the log has
    them)."""
    log.error("step_failed", step_id=step_id, error=repr(exc), exc_info=exc)
    return StepOutput(step_id=step_id, request_ids=(), sampled_token_ids=np.zeros(0, np.int64),
                      logprobs=None,
                      stats=StepStats(step_id=step_id, num_reqs=len(request_ids), num_tokens=0,
                                      num_prefill_tokens=0),
                      error=f"the engine failed to run step {step_id} ({type(exc).__name__}); "
                            "the server log has the details", failed_request_ids=request_ids)


class GPUActorV2(_GPUActorBase):
    name = "gpu_v2"

    def __init__(self, runner: Any, on_step_output: Callable[[StepOutput], None]) -> None:
        super().__init__(runner, on_step_output)
        self._launched: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def _thread_main(self) -> None:
        completer = threading.Thread(target=self._complete_loop, name="tandem-gpu-complete",
                                     daemon=True)
        completer.start()
        try:
            self._launch_loop()
        finally:
            self._launched.put(_STOP)
            completer.join()

    def _launch_loop(self) -> None:
        while (sched := self._inbox.get()) is not _STOP:
            self._launched.put(self._execute(sched))

    def _complete_loop(self) -> None:
        bind_actor(self.name)  # a plain thread starts with an empty context
        while (pending := self._launched.get()) is not _STOP:
            if isinstance(pending, StepOutput):
                self._post(pending)
                continue
            try:
                self._post(pending.result())
            except Exception as exc:  # noqa: BLE001
                self._post(failed_step(pending.step_id, pending.request_ids, exc))


class GPUActorV1(_GPUActorBase):
    name = "gpu_v1"

    def _thread_main(self) -> None:
        while (sched := self._inbox.get()) is not _STOP:
            self._post(self._execute(sched))
