"""The critical path of a deferred grammar mask, timed link by link inside the engine: step
S-1's output posted by the GPU thread -> applied on the core thread (its tokens advance
the matchers) -> step S's mask submitted to the filler -> the fill starts on the filler's
thread and ends -> the mask is provided -> the runner's thread, waiting before it samples
step S, gets it. A link that waits for the GIL shows as a gap between two of these.

    chain = MaskChain.install()    # patches the engine's classes, before the engine runs
    ...                            # run constrained requests
    print(chain.summary())         # medians per link, in ms; chain.clear() between arms
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict


class MaskChain:
    def __init__(self) -> None:
        self.events: dict[str, dict[int, float]] = defaultdict(dict)
        self.made_ready_by: dict[int, int] = {}
        """Deferred step -> the step whose applied output released its mask."""
        self._applying = threading.local()
        self._pending_steps: dict[int, int] = {}

    @classmethod
    def install(cls) -> MaskChain:
        from actors.core.gpu_actor import _GPUActorBase
        from actors.core.grammar_state import MaskFiller, PendingMask
        from actors.core.scheduler_actor import SchedulerActor
        from gpu.sampling.grammar_mask import DeferredMasks

        chain = cls()
        now = time.perf_counter
        post, apply_step = _GPUActorBase._post, SchedulerActor._apply_step
        submit, fill = MaskFiller.submit, PendingMask.fill
        provide, step_mask = DeferredMasks.provide, DeferredMasks.step_mask

        def timed_post(self, out):  # noqa: ANN001 - the wrapped methods' own arguments
            chain.events["post"][out.step_id] = now()
            return post(self, out)

        def timed_apply(self, out):  # noqa: ANN001
            chain.events["apply_start"][out.step_id] = now()
            chain._applying.step_id = out.step_id
            try:
                return apply_step(self, out)
            finally:
                chain.events["apply_end"][out.step_id] = now()

        def timed_submit(self, step_id, pending):  # noqa: ANN001
            chain.events["submit"][step_id] = now()
            chain.made_ready_by[step_id] = getattr(chain._applying, "step_id", -1)
            chain._pending_steps[id(pending)] = step_id
            return submit(self, step_id, pending)

        def timed_fill(self):  # noqa: ANN001
            step_id = chain._pending_steps.pop(id(self), None)
            started = now()
            try:
                return fill(self)
            finally:
                if step_id is not None:
                    chain.events["fill_start"][step_id] = started
                    chain.events["fill_end"][step_id] = now()

        def timed_provide(self, step_id, mask):  # noqa: ANN001
            chain.events["provide"][step_id] = now()
            return provide(self, step_id, mask)

        def timed_step_mask(self, sched):  # noqa: ANN001
            started = now()
            mask = step_mask(self, sched)
            if sched.grammar_mask_deferred:
                chain.events["wait_start"][sched.step_id] = started
                chain.events["wait_end"][sched.step_id] = now()
            return mask

        _GPUActorBase._post, SchedulerActor._apply_step = timed_post, timed_apply
        MaskFiller.submit, PendingMask.fill = timed_submit, timed_fill
        DeferredMasks.provide, DeferredMasks.step_mask = timed_provide, timed_step_mask
        return chain

    def clear(self) -> None:
        self.events.clear()
        self.made_ready_by.clear()

    LINKS = (("post", "apply_start", "posted -> applied (core loop)"),
             ("apply_start", "submit", "applied -> mask submitted (tokens advance matchers)"),
             ("submit", "fill_start", "submitted -> fill starts (filler thread)"),
             ("fill_start", "fill_end", "fill"),
             ("fill_end", "provide", "filled -> provided"),
             ("ready", "wait_end", "provided, runner waiting -> runner has it"),
             ("post", "wait_end", "whole chain: previous output posted -> runner has mask"),
             ("wait_start", "wait_end", "runner waits before sampling"))

    def summary(self) -> dict[str, dict[str, float]]:
        """Median and mean ms per link over the deferred steps that have every event."""
        gaps: dict[str, list[float]] = defaultdict(list)
        for step_id, source in self.made_ready_by.items():
            at = {name: (self.events[name].get(source) if name in ("post", "apply_start")
                         else self.events[name].get(step_id))
                  for name in ("post", "apply_start", "submit", "fill_start", "fill_end",
                               "provide", "wait_start", "wait_end")}
            if any(value is None for value in at.values()):
                continue
            at["ready"] = max(at["provide"], at["wait_start"])
            for start, end, label in self.LINKS:
                gaps[label].append((at[end] - at[start]) * 1e3)
            gaps["runner waited for the mask (share)"].append(
                float(at["wait_start"] < at["provide"]))
        return {label: {"median": round(statistics.median(values), 3),
                        "mean": round(statistics.fmean(values), 3), "num_steps": len(values)}
                for label, values in gaps.items()}
