"""The device state a V2 runner steps on, allocated once per loaded model.

The CUDA graphs of the step (gpu/cuda_graphs.py) are captured at startup and read and
write this state in place: the row table, the sampling parameters, the step buffers, and
the graphs' hidden-state and logits outputs. So the state must outlive any one runner and
keep its addresses: the worker owns it, and a V2 runner claims it (resetting it) for its
life, releasing it on `close` (or by being collected). While one runner holds it, another
runner on the same model (two engines at once, as tests run servers) gets a private state
of its own and runs without graphs. A runner never steps on a state it does not hold.
"""

from __future__ import annotations

import gc
import weakref

import torch

from gpu.input_buffers import InputBuffers
from gpu.runner_v2.states import RequestStates
from gpu.sampling.sampler import Sampler
from gpu.sampling.state import SamplingState


class V2StepState:
    def __init__(
        self,
        buffers: InputBuffers,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        with_graph_outputs: bool,
    ) -> None:
        device = buffers.device
        self._sizes = (max_model_len, max_blocks_per_req, vocab_size, hidden_size, dtype)
        self.buffers = buffers
        self.states = RequestStates(buffers.max_num_reqs, max_model_len, max_blocks_per_req, device)
        self.sampling_state = SamplingState(buffers.max_num_reqs, vocab_size, device)
        self.sampler = Sampler(self.sampling_state)
        self.hidden: torch.Tensor | None = (
            None  # [max_num_tokens, hidden_size]: forward graphs' output
        )
        self.logits: torch.Tensor | None = (
            None  # [max_num_reqs, vocab_size] float32: head graphs' output
        )
        if with_graph_outputs:
            self.hidden = torch.zeros(
                buffers.max_num_tokens, hidden_size, dtype=dtype, device=device
            )
            self.logits = torch.zeros(
                buffers.max_num_reqs, vocab_size, dtype=torch.float32, device=device
            )
        self._owner: weakref.ref | None = None

    def private_twin(self) -> V2StepState:
        """A state of the same sizes for a runner of its own, without graph outputs (while
        another runner holds this one)."""
        max_model_len, max_blocks_per_req, vocab_size, hidden_size, dtype = self._sizes
        shared = self.buffers
        buffers = InputBuffers(
            shared.max_num_reqs, shared.max_num_tokens, max_blocks_per_req, shared.device
        )
        return V2StepState(
            buffers, max_model_len, max_blocks_per_req, vocab_size, hidden_size, dtype, False
        )

    def try_claim(self, owner: object, num_rows: int) -> bool:
        """Hand the state to `owner` with every row free (rows [0, num_rows) offered), unless
        another live owner holds it."""
        if self._holder() is not None:
            gc.collect()  # a finished engine's runner may wait only for the cycle collector
            if self._holder() is not None:
                return False
        self.states.reset(num_rows)
        self.sampling_state.reset()
        self._owner = weakref.ref(owner)
        return True

    def release(self, owner: object) -> None:
        if self._holder() is owner:
            self._owner = None

    def check_owner(self, owner: object) -> None:
        if self._holder() is not owner:
            raise RuntimeError(
                "this V2 runner no longer holds its step state (closed, or "
                "taken over once released); it cannot step"
            )

    def _holder(self) -> object | None:
        return None if self._owner is None else self._owner()
