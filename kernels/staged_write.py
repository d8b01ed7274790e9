"""Batched ragged row writes into a 2-D device tensor with one copy and one launch.

The runner stages small diffs on the CPU while it prepares a step (a new request's prompt
into the token history, new block ids into the block table, ...) and applies them all
at once: the values are concatenated into one pinned host buffer, the (row, start,
cu_lens) index arrays into another, both are copied to the device without blocking and a
single kernel scatters them, one program per write:

    target[rows[k], starts[k] : starts[k] + len_k] = contents[cu_lens[k] : cu_lens[k + 1]]

Where staged writes overlap, the one staged later wins.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kernels._checks import (
    check_contiguous_rows,
    check_same_device,
    check_triton_device,
    need_triton,
)
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 128
MIN_HOST_BUFFERS = 3

if HAS_TRITON:

    @triton.jit
    def _staged_write_kernel(
        target_ptr,
        target_stride,
        rows_ptr,
        starts_ptr,
        cu_lens_ptr,
        contents_ptr,
        BLOCK_SIZE: tl.constexpr,
    ):
        write_idx = tl.program_id(0)
        row = tl.load(rows_ptr + write_idx)
        start = tl.load(starts_ptr + write_idx)
        content_start = tl.load(cu_lens_ptr + write_idx)
        content_end = tl.load(cu_lens_ptr + write_idx + 1)
        row_ptr = target_ptr + row * target_stride + start - content_start
        for block_start in range(content_start, content_end, BLOCK_SIZE):
            offsets = block_start + tl.arange(0, BLOCK_SIZE)
            mask = offsets < content_end
            values = tl.load(contents_ptr + offsets, mask=mask)
            tl.store(row_ptr + offsets, values, mask=mask)


def _check_args(
    target: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    cu_lens: torch.Tensor,
    contents: torch.Tensor,
) -> None:
    if target.dim() != 2:
        raise ValueError(f"target must be 2-D, got shape {tuple(target.shape)}")
    for name, index in (("rows", rows), ("starts", starts), ("cu_lens", cu_lens)):
        if index.dtype != torch.int64 or index.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D int64 tensor, got {index.dtype} {tuple(index.shape)}"
            )
    if not rows.shape[0] == starts.shape[0] == cu_lens.shape[0] - 1:
        raise ValueError(
            f"rows ({rows.shape[0]}) and starts ({starts.shape[0]}) need one entry per "
            f"write and cu_lens ({cu_lens.shape[0]}) one more"
        )
    if contents.dim() != 1 or contents.dtype != target.dtype:
        raise ValueError(
            f"contents must be 1-D {target.dtype}, got {contents.dtype} {tuple(contents.shape)}"
        )
    check_same_device(target=target, rows=rows, starts=starts, cu_lens=cu_lens, contents=contents)


def staged_write_ref(
    target: torch.Tensor,  # [num_rows, row_len] any dtype, written in place
    rows: torch.Tensor,  # [num_writes] int64, target row of each write
    starts: torch.Tensor,  # [num_writes] int64, first column of each write
    cu_lens: torch.Tensor,  # [num_writes + 1] int64, cumsum of write lengths (starts at 0)
    contents: torch.Tensor,  # [cu_lens[-1]] target.dtype, the writes' values back to back
) -> None:
    """Torch reference of `staged_write`."""
    _check_args(target, rows, starts, cu_lens, contents)
    num_values = contents.shape[0]
    value_idx = torch.arange(num_values, device=contents.device)
    write_of_value = torch.searchsorted(cu_lens[1:], value_idx, right=True)
    cols = starts[write_of_value] + value_idx - cu_lens[write_of_value]
    target[rows[write_of_value], cols] = contents


def staged_write_triton(
    target: torch.Tensor,  # [num_rows, row_len], rows contiguous, written in place
    rows: torch.Tensor,  # [num_writes] int64
    starts: torch.Tensor,  # [num_writes] int64
    cu_lens: torch.Tensor,  # [num_writes + 1] int64
    contents: torch.Tensor,  # [cu_lens[-1]] target.dtype, contiguous
) -> None:
    """Triton launcher of `staged_write`: one program per write."""
    need_triton("staged_write_triton")
    _check_args(target, rows, starts, cu_lens, contents)
    check_triton_device("staged_write_triton", target.device)
    check_contiguous_rows(
        target=target, rows=rows, starts=starts, cu_lens=cu_lens, contents=contents
    )
    if rows.shape[0] == 0:
        return
    _staged_write_kernel[(rows.shape[0],)](
        target,
        target.stride(0),
        rows,
        starts,
        cu_lens,
        contents,
        BLOCK_SIZE=_BLOCK_SIZE,
    )


def staged_write(
    target: torch.Tensor,  # [num_rows, row_len], written in place
    rows: torch.Tensor,  # [num_writes] int64
    starts: torch.Tensor,  # [num_writes] int64
    cu_lens: torch.Tensor,  # [num_writes + 1] int64
    contents: torch.Tensor,  # [cu_lens[-1]] target.dtype
) -> None:
    """Scatter ragged writes into target: Triton on CUDA tensors, the torch reference otherwise."""
    impl = staged_write_triton if HAS_TRITON and target.is_cuda else staged_write_ref
    impl(target, rows, starts, cu_lens, contents)


@dataclass(slots=True)
class _HostBuffers:
    """One slot of the host-buffer pool; `copy_done` marks when the device has read it."""

    contents_cpu: torch.Tensor | None = None
    index_cpu: torch.Tensor | None = None
    copy_done: torch.cuda.Event | None = None


class StagedWrites:
    """Collects ragged row writes on the CPU and applies them to a 2-D tensor in one launch.

    Pinned host buffers rotate over a pool of `num_host_buffers` (at least 3). A
    non-blocking host-to-device copy only reads its pinned source when the stream reaches
    it. With two steps in flight, the copies staged for steps N and N + 1 may both still
    be queued behind GPU work while the CPU prepares step N + 2, so refilling either
    buffer would corrupt a pending copy: step N + 2 must use a third one. Each slot also
    records an event after its copy and waits on it before it is refilled, so a deeper
    queue stalls the CPU instead of corrupting data (with 3 slots the wait normally finds
    the copy long done). For a CPU target the pool holds plain buffers and the torch
    reference does the scatter.
    """

    def __init__(self, pin_memory: bool = True, num_host_buffers: int = MIN_HOST_BUFFERS) -> None:
        if num_host_buffers < MIN_HOST_BUFFERS:
            raise ValueError(
                f"num_host_buffers must be at least {MIN_HOST_BUFFERS}, got {num_host_buffers}"
            )
        self._pin_memory = pin_memory
        self._pool = [_HostBuffers() for _ in range(num_host_buffers)]
        self._next_slot = 0
        self._rows: list[int] = []
        self._starts: list[int] = []
        self._values: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._rows)

    def stage(self, row: int, start: int, values: np.ndarray) -> None:
        """Queue target[row, start : start + len(values)] = values for the next `apply`."""
        values = np.asarray(values)
        if values.ndim != 1:
            raise ValueError(f"values must be 1-D, got shape {values.shape}")
        if row < 0 or start < 0:
            raise ValueError(f"row ({row}) and start ({start}) must be >= 0")
        if values.size == 0:
            return
        self._rows.append(int(row))
        self._starts.append(int(start))
        self._values.append(values)

    def clear(self) -> None:
        self._rows.clear()
        self._starts.clear()
        self._values.clear()

    def apply(self, target: torch.Tensor) -> None:
        """Write everything staged into target, then clear.

        One copy pair and one launch, unless a write overlaps an earlier one: then the
        writes are split into runs applied in staging order, so the later write wins.
        """
        if not self._rows:
            return
        try:
            np_dtype = self._numpy_dtype(target)
            rows_np, starts_np, lens_np = self._checked_index(target)
            for group in _non_overlapping_runs(rows_np, starts_np, lens_np):
                cu_lens_np = np.zeros(group.shape[0] + 1, dtype=np.int64)
                np.cumsum(lens_np[group], out=cu_lens_np[1:])
                contents_np = np.concatenate([self._values[k] for k in group.tolist()])
                self._copy_and_launch(
                    target,
                    rows_np[group],
                    starts_np[group],
                    cu_lens_np,
                    contents_np.astype(np_dtype, copy=False),
                )
        finally:
            self.clear()

    def _checked_index(self, target: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if target.dim() != 2:
            raise ValueError(f"target must be 2-D, got shape {tuple(target.shape)}")
        rows_np = np.asarray(self._rows, dtype=np.int64)
        starts_np = np.asarray(self._starts, dtype=np.int64)
        lens_np = np.asarray([v.shape[0] for v in self._values], dtype=np.int64)
        ends_np = starts_np + lens_np
        num_rows, row_len = target.shape
        bad = np.flatnonzero((rows_np >= num_rows) | (ends_np > row_len))
        if bad.size:
            k = int(bad[0])
            raise ValueError(
                f"staged write to row {rows_np[k]}, columns [{starts_np[k]}, {ends_np[k]}) "
                f"is outside the target of shape {tuple(target.shape)}"
            )
        return rows_np, starts_np, lens_np

    def _numpy_dtype(self, target: torch.Tensor) -> np.dtype:
        try:
            target_np_dtype = torch.empty(0, dtype=target.dtype).numpy().dtype
        except TypeError as err:
            raise ValueError(f"StagedWrites does not support target dtype {target.dtype}") from err
        for values in self._values:
            if not np.can_cast(values.dtype, target_np_dtype, casting="same_kind"):
                raise ValueError(f"cannot stage {values.dtype} values into a {target.dtype} target")
        return target_np_dtype

    def _copy_and_launch(
        self,
        target: torch.Tensor,
        rows_np: np.ndarray,
        starts_np: np.ndarray,
        cu_lens_np: np.ndarray,
        contents_np: np.ndarray,
    ) -> None:
        slot = self._pool[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._pool)
        if slot.copy_done is not None:
            slot.copy_done.synchronize()
        num_writes = rows_np.shape[0]
        index_len = 3 * num_writes + 1
        pin = self._pin_memory and target.is_cuda
        slot.index_cpu = self._fit(slot.index_cpu, index_len, torch.int64, pin)
        slot.contents_cpu = self._fit(slot.contents_cpu, contents_np.shape[0], target.dtype, pin)
        index_np = slot.index_cpu.numpy()
        index_np[:num_writes] = rows_np
        index_np[num_writes : 2 * num_writes] = starts_np
        index_np[2 * num_writes : index_len] = cu_lens_np
        slot.contents_cpu.numpy()[: contents_np.shape[0]] = contents_np

        index_gpu = slot.index_cpu[:index_len].to(target.device, non_blocking=True)
        contents_gpu = slot.contents_cpu[: contents_np.shape[0]].to(
            target.device, non_blocking=True
        )
        if target.is_cuda:
            if slot.copy_done is None:
                slot.copy_done = torch.cuda.Event()
            slot.copy_done.record(torch.cuda.current_stream(target.device))
        staged_write(
            target,
            index_gpu[:num_writes],
            index_gpu[num_writes : 2 * num_writes],
            index_gpu[2 * num_writes :],
            contents_gpu,
        )

    @staticmethod
    def _fit(
        buffer: torch.Tensor | None, min_len: int, dtype: torch.dtype, pin: bool
    ) -> torch.Tensor:
        if (
            buffer is not None
            and buffer.dtype == dtype
            and buffer.shape[0] >= min_len
            and buffer.is_pinned() == pin
        ):
            return buffer
        # Grow geometrically; the replaced buffer's last copy has completed (slot event).
        new_len = max(min_len, 2 * buffer.shape[0] if buffer is not None else 256)
        return torch.empty(new_len, dtype=dtype, pin_memory=pin)


def _non_overlapping_runs(
    rows_np: np.ndarray,  # [num_writes] int64
    starts_np: np.ndarray,  # [num_writes] int64
    lens_np: np.ndarray,  # [num_writes] int64
) -> list[np.ndarray]:
    """Split writes, in staging order, into runs without overlaps inside a run.

    Programs of one launch run in any order, so a write that overlaps an earlier one goes
    into a later launch. The common case (no overlap) is checked without a Python loop.
    """
    ends_np = starts_np + lens_np
    order = np.lexsort((starts_np, rows_np))
    same_row = rows_np[order][1:] == rows_np[order][:-1]
    if not np.any(same_row & (starts_np[order][1:] < ends_np[order][:-1])):
        return [np.arange(rows_np.shape[0])]
    runs: list[np.ndarray] = []
    run: list[int] = []
    spans: dict[int, list[tuple[int, int]]] = {}
    for k, (row, start, end) in enumerate(
        zip(rows_np.tolist(), starts_np.tolist(), ends_np.tolist())
    ):
        if any(s < end and start < e for s, e in spans.get(row, ())):
            runs.append(np.asarray(run, dtype=np.int64))
            run, spans = [], {}
        run.append(k)
        spans.setdefault(row, []).append((start, end))
    runs.append(np.asarray(run, dtype=np.int64))
    return runs
