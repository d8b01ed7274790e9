"""A step's row edits on a V2 runner, before it launches: finished requests leave their
rows, new requests take rows with their sampling parameters, running ones get their new
KV blocks; the staged writes then reach the device in one pass."""

from __future__ import annotations

import numpy as np

from actors.protocol.messages import SchedulerOutput
from gpu.prompt_embeds import RequestEmbeds
from gpu.prompt_logprobs import PromptRequest
from gpu.runner_v2.states import RequestStates
from gpu.sampling.state import SamplingState


class RowSync:
    """The runner's per-row records that follow the scheduler's row edits."""

    def __init__(
        self,
        states: RequestStates,
        sampling_state: SamplingState,
        num_logprobs_np: np.ndarray,  # [max_num_reqs] int64, -1: no logprobs
        prompt_requests: dict[str, PromptRequest],
        embeds: RequestEmbeds | None,
        default_seed: int,
    ) -> None:
        self.states = states
        self.sampling_state = sampling_state
        self.num_logprobs_np = num_logprobs_np
        self.prompt_requests = prompt_requests
        self.embeds = embeds
        self.default_seed = default_seed

    def apply(self, sched: SchedulerOutput) -> None:
        for request_id in sorted(sched.finished_request_ids):
            self._remove(request_id)
        for new in sched.new_requests:
            row = self.states.add(new)
            params = new.sampling_params
            if params.prompt_logprobs is not None:
                self.prompt_requests[new.request_id] = PromptRequest(
                    params.prompt_logprobs, new.token_ids[: new.prompt_len]
                )
            if self.embeds is not None:
                self.embeds.add(new.request_id, new.prompt_embeds)
            self.sampling_state.add_new_request(row, new, self.default_seed)
            self.num_logprobs_np[row] = -1 if params.logprobs is None else params.logprobs
        cached = sched.cached_requests
        for request_id, block_ids in zip(cached.request_ids, cached.new_block_ids):
            self.states.append_blocks(request_id, block_ids)
        self.states.apply_staged()
        self.sampling_state.flush_to_device()

    def _remove(self, request_id: str) -> None:
        row = self.states.remove(request_id)
        self.prompt_requests.pop(request_id, None)
        if self.embeds is not None:
            self.embeds.remove(request_id)
        if row is not None:
            self.sampling_state.remove_request(row)
            self.num_logprobs_np[row] = -1
