"""The GPU actor: the runner the startup rules chose (V2 or V1, gpu.runner.Runner), on two
threads of its own, so that the engine loop never waits for the device.

    done = gpu.launch(sched)     # on the event loop: returns at once, an asyncio future
    out = done.result()          # once done: the step's StepOutput

The launcher thread calls `runner.execute` for each step in submission order: the V2
runner returns while the device runs the step, so step N+1 is launched while step N runs;
the V1 runner finishes the step there. The completion thread waits for each step's outputs
on the host, in order, and resolves its future on the event loop. A step that raises fails
its own requests (a failed StepOutput), never the engine.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

import anyio
import msgspec
import numpy as np
import structlog

from actors.protocol.messages import SchedulerOutput, StepOutput, StepStats
from gpu.runner import LaunchedStep, ReadyStep, Runner
from telemetry.logging import bind_actor

log = structlog.get_logger("tandem.gpu_actor")
Done = asyncio.Future[StepOutput]


class GPUActor:
    def __init__(
        self, runner: Runner, kv_loads_done_through: Callable[[], int] | None = None
    ) -> None:
        """`kv_loads_done_through`: the worker's newest finished offload load, reported
        with each step's outputs (when the offload tiers are on)."""
        self.runner = runner
        self._kv_loads_done_through = kv_loads_done_through
        self.name = f"gpu_{runner.name}"
        self._to_launch: queue.SimpleQueue[tuple[SchedulerOutput, Done] | None] = (
            queue.SimpleQueue()
        )
        """Steps to launch, in order; None stops the threads."""
        self._launched: queue.SimpleQueue[tuple[LaunchedStep, Done] | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rows_to_free: frozenset[str] = frozenset()
        """Finished requests a failed step may not have freed (launcher thread only)."""
        self._threads_ended = threading.Event()

    @property
    def max_steps_in_flight(self) -> int:
        return self.runner.max_steps_in_flight

    def launch(self, sched: SchedulerOutput) -> asyncio.Future[StepOutput]:
        """Queue the step for the device; its outputs resolve the returned future."""
        assert self._loop is not None, "launch before run"
        done: Done = self._loop.create_future()
        self._to_launch.put((sched, done))
        return done

    def close(self) -> None:
        """Stop after the steps already launched (a step waiting for its grammar mask
        fails instead of waiting)."""
        self._to_launch.put(None)
        self.runner.deferred_masks.close()

    async def run(self) -> None:
        """Run the threads until `close()`; then give the runner's state back."""
        self._loop = asyncio.get_running_loop()
        bind_actor(self.name)  # anyio copies this task's context into the worker thread
        try:
            await anyio.to_thread.run_sync(self._run_threads, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            # Cancelled (another part of the engine died): stop the threads, which would
            # otherwise wait for steps forever, and let a running step end before the
            # runner is closed.
            self.close()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._threads_ended.wait)
            raise
        finally:
            self.runner.close()

    def _run_threads(self) -> None:
        completer = threading.Thread(
            target=self._complete_loop, name="tandem-gpu-complete", daemon=True
        )
        completer.start()
        try:
            self._launch_loop()
        finally:
            self._launched.put(None)
            completer.join()
            self._threads_ended.set()

    def _launch_loop(self) -> None:
        while (job := self._to_launch.get()) is not None:
            sched, done = job
            self._launched.put((self._execute(sched), done))

    def _complete_loop(self) -> None:
        bind_actor(self.name)  # a plain thread starts with an empty context
        while (launched := self._launched.get()) is not None:
            step, done = launched
            try:
                out = step.result()
            except Exception as exc:  # noqa: BLE001 - the step fails, the engine goes on
                out = failed_step(step.step_id, step.request_ids, exc)
            if self._kv_loads_done_through is not None:
                out = msgspec.structs.replace(
                    out, kv_loads_done_through=self._kv_loads_done_through()
                )
            assert self._loop is not None
            self._loop.call_soon_threadsafe(_resolve, done, out)

    def _execute(self, sched: SchedulerOutput) -> LaunchedStep:
        """`runner.execute`, or a failed step when it raises. A step can fail before the
        runner freed the rows it was told to free, and nothing would name those finished
        requests again: they are freed with the next step (freeing is idempotent). The
        step's own requests are named again once they fail."""
        if self._rows_to_free:
            sched = msgspec.structs.replace(
                sched, finished_request_ids=sched.finished_request_ids | self._rows_to_free
            )
            self._rows_to_free = frozenset()
        try:
            return self.runner.execute(sched)
        except Exception as exc:  # noqa: BLE001 - a failed step must not kill the engine
            re_added = {new.request_id for new in sched.new_requests}
            self._rows_to_free = sched.finished_request_ids - re_added
            return ReadyStep(
                failed_step(sched.step_id, sched.scheduled_request_ids, exc),
                sched.scheduled_request_ids,
            )


def _resolve(done: Done, out: StepOutput) -> None:
    if not done.done():  # a future cancelled at shutdown is left as it is
        done.set_result(out)


def failed_step(step_id: int, request_ids: tuple[str, ...], exc: BaseException) -> StepOutput:
    """A step that raised: every request in it fails; the engine keeps serving the rest. The
    error its requests end with reaches their clients, so it names no internals (the log has
    them)."""
    log.error("step_failed", step_id=step_id, error=repr(exc), exc_info=exc)
    return StepOutput(
        step_id=step_id,
        request_ids=(),
        sampled_token_ids=np.zeros(0, np.int64),
        logprobs=None,
        stats=StepStats(
            step_id=step_id, num_reqs=len(request_ids), num_tokens=0, num_prefill_tokens=0
        ),
        error=f"the engine failed to run step {step_id} ({type(exc).__name__}); "
        "the server log has the details",
        failed_request_ids=request_ids,
    )
