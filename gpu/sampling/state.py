"""Per-request sampling parameters of the V2 runner, one row per request for its whole life.

Every parameter lives twice: a numpy mirror on the CPU (written by add/remove_request and
read by the sampler to decide, without a device sync, which ops a batch needs) and a
device tensor of shape [max_num_reqs] read by the kernels through idx_mapping. The scalar
mirrors are packed into one host buffer and the logit-bias/stop-id tables into another, so
`flush_to_device` uploads each group that changed in a single copy (from fresh pinned
memory on CUDA, which the caching host allocator keeps alive until the copy has run, so
the CPU never overwrites memory an in-flight copy still reads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from actors.protocol.messages import NewRequestData
from actors.protocol.sampling_params import SamplingParams, SamplingParamsError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as greedy (stored as 0)."""

_SCALAR_DTYPES: dict[str, type[np.generic]] = {
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "min_p": np.float32,
    "seed": np.int64,
    "repetition_penalty": np.float32,
    "frequency_penalty": np.float32,
    "presence_penalty": np.float32,
    "min_tokens": np.int32,
    "num_logit_bias": np.int32,
    "num_stop_token_ids": np.int32,
}
_NEUTRAL_VALUES = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0}
_MIN_TABLE_WIDTH = 8


class MirroredArrays:
    """Named numpy arrays packed into one host byte buffer, with typed views of one device
    byte buffer of the same layout, so that uploading all of them takes one copy."""

    def __init__(
        self, specs: dict[str, tuple[tuple[int, ...], type[np.generic]]], device: torch.device
    ) -> None:
        layout: dict[str, tuple[int, int]] = {}
        num_bytes = 0
        for name, (shape, dtype) in specs.items():
            field_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            layout[name] = (num_bytes, field_bytes)
            num_bytes += -(-field_bytes // 8) * 8  # 8-byte aligned, so every view is aligned
        self._host = np.zeros(max(num_bytes, 8), dtype=np.uint8)
        self._device_bytes = torch.zeros(self._host.size, dtype=torch.uint8, device=device)
        self.np: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in specs.items():
            start, field_bytes = layout[name]
            torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
            self.np[name] = self._host[start : start + field_bytes].view(dtype).reshape(shape)
            self.device[name] = (
                self._device_bytes[start : start + field_bytes].view(torch_dtype).view(shape)
            )
        self.is_dirty = True

    def upload(self) -> None:
        """Copy the host buffer to the device if anything changed since the last upload."""
        if not self.is_dirty:
            return
        if self._device_bytes.is_cuda:
            staging = torch.empty(self._host.size, dtype=torch.uint8, pin_memory=True)
            staging.numpy()[:] = self._host
            self._device_bytes.copy_(staging, non_blocking=True)
        else:
            self._device_bytes.copy_(torch.from_numpy(self._host))
        self.is_dirty = False


class SamplingState:
    """Sampling parameters and penalty state for `max_num_reqs` request rows.

    Numpy mirrors: `temperature_np`, `top_k_np`, ... (one per name in _SCALAR_DTYPES);
    device tensors: `temperature_gpu`, ..., plus the tables `logit_bias_token_ids_gpu`,
    `logit_bias_values_gpu`, `stop_token_ids_gpu` ([max_num_reqs, width], width grows on
    demand) and, once a request uses penalties, `prompt_mask_gpu` [max_num_reqs, vocab]
    bool and `output_counts_gpu` [max_num_reqs, vocab] int32 (None until then).
    Normalisation: greedy rows (temperature < GREEDY_TEMPERATURE) store temperature 0 and
    no top-k/top-p/min-p; top_k 0 means off; min_tokens is 0 when there is nothing to
    suppress. Call `flush_to_device` before the kernels read a step's parameters.
    """

    # Set in __init__ from _SCALAR_DTYPES; declared here for readers and type checkers.
    temperature_np: np.ndarray
    top_k_np: np.ndarray
    top_p_np: np.ndarray
    min_p_np: np.ndarray
    seed_np: np.ndarray
    repetition_penalty_np: np.ndarray
    frequency_penalty_np: np.ndarray
    presence_penalty_np: np.ndarray
    min_tokens_np: np.ndarray
    num_logit_bias_np: np.ndarray
    num_stop_token_ids_np: np.ndarray
    temperature_gpu: torch.Tensor
    top_k_gpu: torch.Tensor
    top_p_gpu: torch.Tensor
    min_p_gpu: torch.Tensor
    seed_gpu: torch.Tensor
    repetition_penalty_gpu: torch.Tensor
    frequency_penalty_gpu: torch.Tensor
    presence_penalty_gpu: torch.Tensor
    min_tokens_gpu: torch.Tensor
    num_logit_bias_gpu: torch.Tensor
    num_stop_token_ids_gpu: torch.Tensor

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str) -> None:
        if not isinstance(max_num_reqs, int) or max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be a positive int, got {max_num_reqs!r}")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._scalars = MirroredArrays(
            {name: ((max_num_reqs,), dtype) for name, dtype in _SCALAR_DTYPES.items()}, self.device
        )
        for name, array in self._scalars.np.items():
            array[:] = _NEUTRAL_VALUES.get(name, 0)
            setattr(self, f"{name}_np", array)
            setattr(self, f"{name}_gpu", self._scalars.device[name])
        self._tables = self._new_tables(_MIN_TABLE_WIDTH, _MIN_TABLE_WIDTH)
        self.prompt_mask_gpu: torch.Tensor | None = None
        self.output_counts_gpu: torch.Tensor | None = None
        self.uses_penalties_np = np.zeros(max_num_reqs, dtype=np.bool_)
        # row -> (prompt ids, output ids) whose penalty state is rebuilt at the next flush.
        self._pending_penalty_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def logit_bias_token_ids_gpu(self) -> torch.Tensor:  # [max_num_reqs, bias_width] int32
        return self._tables.device["logit_bias_token_ids"]

    @property
    def logit_bias_values_gpu(self) -> torch.Tensor:  # [max_num_reqs, bias_width] float32
        return self._tables.device["logit_bias_values"]

    @property
    def stop_token_ids_gpu(self) -> torch.Tensor:  # [max_num_reqs, stop_width] int32
        return self._tables.device["stop_token_ids"]

    def add_new_request(self, row: int, new: NewRequestData, engine_seed: int) -> None:
        """`add_request` for a request the scheduler starts (or resumes) in `row`: penalties
        see its prompt tokens (none with prompt embeddings) and the outputs before a
        preemption; an unseeded request samples from a seed of the engine's seed and its id."""
        prompt = () if new.prompt_embeds is not None else new.token_ids[: new.prompt_len]
        seed = unseeded_request_seed(engine_seed, new.request_id)
        outputs = new.token_ids[new.prompt_len :]
        self.add_request(row, new.sampling_params, prompt, outputs, new.eos_token_ids, seed)

    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] | np.ndarray,
        output_token_ids: Sequence[int] | np.ndarray,
        eos_token_ids: Sequence[int],
        default_seed: int,
    ) -> None:
        """Take `row` for a new (or resumed) request. `default_seed` is used when the
        request has no seed; output_token_ids are the tokens generated before a preemption.
        Raises SamplingParamsError when a logit_bias or stop token id is outside the vocab."""
        self._check_row(row)
        bias_token_ids, bias_values = self._logit_bias_entries(params)
        stop_token_ids = self._min_tokens_stop_ids(params, eos_token_ids)
        history = None
        if params.uses_penalties:  # validated before anything is written
            history = (
                self._checked_token_ids("prompt_token_ids", prompt_token_ids),
                self._checked_token_ids("output_token_ids", output_token_ids),
            )
        is_greedy = params.temperature < GREEDY_TEMPERATURE
        values = {
            "temperature": 0.0 if is_greedy else params.temperature,
            "top_k": params.top_k if not is_greedy and 0 < params.top_k < self.vocab_size else 0,
            "top_p": 1.0 if is_greedy else params.top_p,
            "min_p": 0.0 if is_greedy else params.min_p,
            "seed": _as_int64(default_seed if params.seed is None else params.seed),
            "repetition_penalty": params.repetition_penalty,
            "frequency_penalty": params.frequency_penalty,
            "presence_penalty": params.presence_penalty,
            "min_tokens": params.min_tokens if stop_token_ids.size else 0,
            "num_logit_bias": bias_token_ids.size,
            "num_stop_token_ids": stop_token_ids.size,
        }
        for name, value in values.items():
            self._scalars.np[name][row] = value
        self._scalars.is_dirty = True
        self._write_tables(row, bias_token_ids, bias_values, stop_token_ids)
        self.uses_penalties_np[row] = history is not None
        self._pending_penalty_rows.pop(row, None)
        if history is not None:
            self._pending_penalty_rows[row] = history

    def reset(self) -> None:
        """Every row back to neutral values and no pending penalty rebuild (a new runner
        takes over this state)."""
        for name, array in self._scalars.np.items():
            array[:] = _NEUTRAL_VALUES.get(name, 0)
        self._scalars.is_dirty = True
        self.uses_penalties_np[:] = False
        self._pending_penalty_rows.clear()

    def remove_request(self, row: int) -> None:
        """Free `row`: its parameters go back to neutral values."""
        self._check_row(row)
        for name, array in self._scalars.np.items():
            array[row] = _NEUTRAL_VALUES.get(name, 0)
        self._scalars.is_dirty = True
        self.uses_penalties_np[row] = False
        self._pending_penalty_rows.pop(row, None)

    def flush_to_device(self) -> None:
        """Upload what changed since the last flush (stream-ordered, no host sync)."""
        self._scalars.upload()
        self._tables.upload()
        if self._pending_penalty_rows:
            self._rebuild_penalty_rows()

    def record_sampled(
        self,
        idx_mapping_gpu: torch.Tensor,  # [num_rows] int32, logit row -> request row
        sampled_token_ids_gpu: torch.Tensor,  # [num_rows] int64
        is_real_gpu: torch.Tensor,  # [num_rows] bool, False for discarded samples
    ) -> None:
        """Count sampled tokens into the output counts, on the device (no sync). Only rows
        that use penalties need counting (a row's counts are rebuilt from its history when
        it is added); rows that use none may be counted too, harmlessly."""
        if self.output_counts_gpu is None:
            return
        self.output_counts_gpu.index_put_(
            (idx_mapping_gpu.long(), sampled_token_ids_gpu.long()),
            is_real_gpu.to(torch.int32),
            accumulate=True,
        )

    def _check_row(self, row: int) -> None:
        if not isinstance(row, (int, np.integer)) or not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row must be an int in [0, {self.max_num_reqs}), got {row!r}")

    def _checked_token_ids(self, name: str, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        array = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise ValueError(
                f"{name} must be in [0, {self.vocab_size}), got values from "
                f"{array.min()} to {array.max()}"
            )
        return array

    def _logit_bias_entries(self, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
        bias_by_token = dict(params.logit_bias)  # a repeated token id keeps its last value
        for token_id in bias_by_token:
            if not 0 <= token_id < self.vocab_size:
                raise SamplingParamsError(
                    "logit_bias",
                    f"logit_bias token id {token_id} is outside the vocabulary "
                    f"[0, {self.vocab_size})",
                )
        return (
            np.fromiter(bias_by_token.keys(), dtype=np.int32, count=len(bias_by_token)),
            np.fromiter(bias_by_token.values(), dtype=np.float32, count=len(bias_by_token)),
        )

    def _min_tokens_stop_ids(
        self, params: SamplingParams, eos_token_ids: Sequence[int]
    ) -> np.ndarray:
        for token_id in params.stop_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise SamplingParamsError(
                    "stop_token_ids",
                    f"stop token id {token_id} is outside the vocabulary [0, {self.vocab_size})",
                )
        if params.min_tokens == 0:
            return np.zeros(0, dtype=np.int32)
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        ids = [t for t in dict.fromkeys((*eos, *params.stop_token_ids)) if 0 <= t < self.vocab_size]
        return np.asarray(ids, dtype=np.int32)

    def _new_tables(self, bias_width: int, stop_width: int) -> MirroredArrays:
        shape_r = self.max_num_reqs
        return MirroredArrays(
            {
                "logit_bias_token_ids": ((shape_r, bias_width), np.int32),
                "logit_bias_values": ((shape_r, bias_width), np.float32),
                "stop_token_ids": ((shape_r, stop_width), np.int32),
            },
            self.device,
        )

    def _write_tables(
        self,
        row: int,
        bias_token_ids: np.ndarray,
        bias_values: np.ndarray,
        stop_token_ids: np.ndarray,
    ) -> None:
        tables = self._tables.np
        bias_width = tables["logit_bias_token_ids"].shape[1]
        stop_width = tables["stop_token_ids"].shape[1]
        if bias_token_ids.size > bias_width or stop_token_ids.size > stop_width:
            old = tables
            self._tables = self._new_tables(
                max(bias_width, _next_pow2(bias_token_ids.size)),
                max(stop_width, _next_pow2(stop_token_ids.size)),
            )
            for name, array in old.items():
                self._tables.np[name][:, : array.shape[1]] = array
            tables = self._tables.np
        tables["logit_bias_token_ids"][row, : bias_token_ids.size] = bias_token_ids
        tables["logit_bias_values"][row, : bias_values.size] = bias_values
        tables["stop_token_ids"][row, : stop_token_ids.size] = stop_token_ids
        if bias_token_ids.size or stop_token_ids.size:
            self._tables.is_dirty = True

    def _ensure_penalty_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prompt_mask_gpu is None or self.output_counts_gpu is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.prompt_mask_gpu = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.output_counts_gpu = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return self.prompt_mask_gpu, self.output_counts_gpu

    def _rebuild_penalty_rows(self) -> None:
        prompt_mask, output_counts = self._ensure_penalty_state()
        pending, self._pending_penalty_rows = self._pending_penalty_rows, {}
        rows = np.fromiter(pending, dtype=np.int64, count=len(pending))
        prompts = [prompt for prompt, _ in pending.values()]
        outputs = [output for _, output in pending.values()]
        prompt_rows = np.repeat(rows, [prompt.size for prompt in prompts])
        output_rows = np.repeat(rows, [output.size for output in outputs])
        packed = self._to_device(
            np.concatenate([rows, prompt_rows, *prompts, output_rows, *outputs])
        )
        rows_gpu, prompt_rows_gpu, prompt_ids_gpu, output_rows_gpu, output_ids_gpu = packed.split(
            [rows.size, prompt_rows.size, prompt_rows.size, output_rows.size, output_rows.size]
        )
        prompt_mask.index_fill_(0, rows_gpu, False)
        output_counts.index_fill_(0, rows_gpu, 0)
        prompt_mask.index_put_(
            (prompt_rows_gpu, prompt_ids_gpu),
            torch.ones(prompt_ids_gpu.numel(), dtype=torch.bool, device=self.device),
        )
        output_counts.index_put_(
            (output_rows_gpu, output_ids_gpu),
            torch.ones(output_ids_gpu.numel(), dtype=torch.int32, device=self.device),
            accumulate=True,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host.to(self.device)
        staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        staging.copy_(host)
        return staging.to(self.device, non_blocking=True)


def _as_int64(seed: int) -> int:
    """Reinterpret any seed in [-2**63, 2**64) as the int64 with the same low 64 bits."""
    seed %= 2**64
    return seed - 2**64 if seed >= 2**63 else seed


def _next_pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def unseeded_request_seed(engine_seed: int, request_id: str) -> int:
    """The sampling seed of a request that set none: distinct per request (so parallel
    samples differ) yet reproducible for a given engine seed and request id."""
    digest = hashlib.blake2b(f"{engine_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
