"""A step's row edits on a V2 runner, before it launches: finished requests leave their
rows, new requests take rows with their sampling parameters, running ones get their new
KV blocks; the staged writes then reach the device in one pass."""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors.protocol.messages import SchedulerOutput
from gpu.prompt_logprobs import PromptRequest
from gpu.sampling.state import unseeded_request_seed

if TYPE_CHECKING:
    from gpu.runner_v2.runner import ModelRunnerV2


def sync_rows(runner: ModelRunnerV2, sched: SchedulerOutput) -> None:
    for request_id in sorted(sched.finished_request_ids):
        row = runner.states.remove(request_id)
        runner.prompt_requests.pop(request_id, None)
        if runner.embeds is not None:
            runner.embeds.remove(request_id)
        if row is not None:
            runner.sampling_state.remove_request(row)
            runner.num_logprobs_np[row] = -1
    for new in sched.new_requests:
        row = runner.states.add(new)
        params = new.sampling_params
        if params.prompt_logprobs is not None:
            runner.prompt_requests[new.request_id] = PromptRequest(
                params.prompt_logprobs, new.token_ids[: new.prompt_len]
            )
        if runner.embeds is not None:
            runner.embeds.add(new.request_id, new.prompt_embeds)
        runner.sampling_state.add_request(
            row,
            params,
            () if new.prompt_embeds is not None else new.token_ids[: new.prompt_len],
            new.token_ids[new.prompt_len :],
            new.eos_token_ids,
            unseeded_request_seed(runner.default_seed, new.request_id),
        )
        runner.num_logprobs_np[row] = -1 if params.logprobs is None else params.logprobs
    cached = sched.cached_requests
    for request_id, block_ids in zip(cached.request_ids, cached.new_block_ids):
        runner.states.append_blocks(request_id, block_ids)
    runner.states.apply_staged()
    runner.sampling_state.flush_to_device()
