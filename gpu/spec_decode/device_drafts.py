"""The V2 runner's drafts: proposed on the device, read by the speculative step.

`propose` runs the ngram kernel (kernels/ngram_propose.py) over a step's rows, on their
persistent token history, and writes each row's drafts twice, both on the device:

- into the token history right after the row's known tokens (positions total_len ..
  total_len + d - 1, which hold nothing yet), so the step's input preparation, which
  reads token_ids[row, num_computed ..], feeds the last token and then the drafts without
  any change (inside the forward CUDA graphs too);
- into `draft_token_ids_gpu` [max_num_reqs, K] (-1 past a row's drafts), which the
  verification compares against the sampled tokens.

When: a speculative step's tail proposes for its rows once their accepted tokens are in
the history, so a speculative step that follows one finds its drafts ready. A plain step
proposes nothing (most steps are plain where drafts do not pay, and none of them would
read a draft); it moves its rows' histories, so the next speculative step first proposes
for its rows (`needs_refresh`; gpu/spec_decode/spec_runner.py replays a captured proposal
where the step's tail is graphed). The two copies of a draft always come from one proposal, which
verification relies on: a draft is accepted only where the token fed after it is the one
the table names.

Nothing crosses to the CPU: the scheduler planned the step with K draft slots per
decoding row before these drafts existed (actors/core/spec_scheduling.py). A slot without a
draft runs whatever the history holds past the drafts (a valid token id: the history
only ever holds tokens), and its -1 table entry keeps it from being accepted.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from actors.protocol.messages import SchedulerOutput
from actors.protocol.speculative_config import SpeculativeConfig
from gpu.runner_v2.states import RequestStates
from kernels.ngram_propose import ngram_propose


class DeviceDrafts:
    trims_on_cpu = True
    """On the CPU the draft counts of the step being prepared are already final (steps run
    one after the other), so speculating rows run only the slots that hold a draft."""

    def __init__(self, config: SpeculativeConfig, max_num_reqs: int, device: torch.device) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.draft_token_ids_gpu = torch.full(
            (max_num_reqs, config.num_speculative_tokens), -1, dtype=torch.int32, device=device
        )
        self.num_drafts_gpu = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self._offsets = torch.arange(config.num_speculative_tokens, device=device)
        self._fresh_rows: np.ndarray | None = None
        """Rows whose drafts match their history as of the last step launched (see the
        module doc); None once a plain step has run."""

    def needs_refresh(
        self,
        rows_np: np.ndarray,  # [num_reqs] int, the speculative step's rows
        num_draft_slots: tuple[int, ...],  # [num_reqs]
    ) -> bool:
        """Whether a speculative step over `rows_np` must propose before it runs: some row
        with draft slots holds no drafts proposed since its history last moved. The step's
        tail proposes again, so afterwards its rows count as fresh."""
        speculating = rows_np[np.asarray(num_draft_slots) > 0]
        stale = self._fresh_rows is None or not np.isin(speculating, self._fresh_rows).all()
        self._fresh_rows = np.array(rows_np, copy=True)
        return stale

    def mark_stale(self) -> None:
        """A plain step was launched: its rows' histories moved past their drafts."""
        self._fresh_rows = None

    def trim_slots(self, sched: SchedulerOutput, states: RequestStates) -> SchedulerOutput:
        """`sched` with each speculating row cut to its last token plus its drafts (CPU
        only: this reads the draft counts, which on a GPU would wait for the device;
        proposed first where stale). The scheduler's correction does not change: it
        counts from the emitted tokens."""
        if not self.trims_on_cpu or self.num_drafts_gpu.is_cuda or not sched.num_draft_slots:
            return sched
        slots = np.asarray(sched.num_draft_slots, dtype=np.int64)
        rows = np.fromiter(
            (states.row_of[r] for r in sched.scheduled_request_ids),
            dtype=np.int64,
            count=slots.size,
        )
        if self.needs_refresh(rows, sched.num_draft_slots):
            self.propose(states, torch.from_numpy(rows.astype(np.int32)))
        trimmed = np.minimum(slots, self.num_drafts_gpu.numpy()[rows])
        num_scheduled = np.asarray(sched.num_scheduled_tokens, dtype=np.int64) - slots + trimmed
        return msgspec.structs.replace(
            sched,
            num_scheduled_tokens=tuple(num_scheduled.tolist()),
            num_draft_slots=tuple(trimmed.tolist()),
        )

    def propose(
        self,
        states: RequestStates,
        idx_mapping_gpu: torch.Tensor,  # [num_reqs] int32, the rows of the step just run
    ) -> None:
        config = self.config
        token_ids = states.token_ids_gpu
        if not token_ids.is_cuda and idx_mapping_gpu.numel():
            # The reference scans whole rows; on the CPU, reading the longest row's length
            # costs nothing and narrows the scan to the columns that can match.
            longest = int(states.total_len_gpu[idx_mapping_gpu.long()].max())
            width = longest + config.num_speculative_tokens + 1
            token_ids = token_ids[:, : min(width, token_ids.shape[1])]
        drafts, num_drafts = ngram_propose(
            token_ids,
            states.total_len_gpu,
            idx_mapping_gpu,
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
        )
        rows = idx_mapping_gpu.long()
        self.draft_token_ids_gpu[rows] = drafts
        self.num_drafts_gpu[rows] = num_drafts
        self._write_history(states, rows, drafts, num_drafts)

    def _write_history(
        self,
        states: RequestStates,
        rows: torch.Tensor,  # [num_reqs] int64
        drafts: torch.Tensor,  # [num_reqs, K] int32, -1 padded
        num_drafts: torch.Tensor,  # [num_reqs] int32
    ) -> None:
        history = states.token_ids_gpu
        max_model_len = history.shape[1]
        total = states.total_len_gpu[rows].long()[:, None]
        columns = (total + self._offsets[None, :]).clamp(max=max_model_len - 1)
        history_rows = rows[:, None].expand_as(columns)
        # A clamped column repeats the row's last one: every entry that lands on a column
        # carries that column's value, so repeated indices agree.
        draft_index = columns - total  # -1 where a row already fills its context
        is_draft = (draft_index >= 0) & (draft_index < num_drafts[:, None])
        values = torch.where(
            is_draft, drafts.gather(1, draft_index.clamp(min=0)), history[history_rows, columns]
        )
        history[history_rows, columns] = values
