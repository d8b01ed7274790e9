"""Process-group setup for one engine's ranks (TP x PP): one process per rank.

Each rank calls `init_tp_group` with the same rendezvous address, world size and pipeline
size. The device collectives run on the default group (NCCL on CUDA, gloo on CPU): the
tensor-parallel ones on their stage's subgroup when there are several stages, the
pipeline's sends and the sampled-token broadcast on the whole group. A second gloo group
carries host-side messages (the step broadcast), so that those never interleave with
device collectives issued from another thread. `TPGroup.close` tears everything down and
may be called more than once.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gpu.distributed.env import apply_worker_env
from gpu.distributed.layout import ParallelLayout

DEFAULT_TIMEOUT_S = 120.0
"""How long a collective may wait for a peer before it fails (a dead or hung rank)."""


class TPGroupError(RuntimeError):
    """The group cannot be formed (bad rank, unreachable rendezvous, duplicate group)."""


@dataclass(frozen=True, slots=True)
class TPGroupSpec:
    rank: int
    world_size: int
    init_method: str
    """Rendezvous: 'tcp://host:port' (rank 0 listens there), 'file:///path' (a file on a
    filesystem every rank sees; it must not exist before the group forms) or 'env://'
    (MASTER_ADDR and MASTER_PORT, as torchrun sets them)."""
    device: str
    """This rank's device: 'cpu' or 'cuda:N'."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    pp_size: int = 1
    """Pipeline stages; world_size / pp_size ranks form each stage's tensor-parallel group
    (gpu/distributed/layout.py)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise TPGroupError(f"world_size must be at least 1, got {self.world_size}")
        if self.pp_size < 1 or self.world_size % self.pp_size:
            raise TPGroupError(
                f"pp_size must be at least 1 and divide world_size {self.world_size}, "
                f"got {self.pp_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise TPGroupError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not self.init_method.startswith(("tcp://", "file://", "env://")):
            raise TPGroupError(
                "init_method must be tcp://host:port, file:///path or env://, "
                f"got {self.init_method!r}"
            )
        if self.timeout_s <= 0:
            raise TPGroupError(f"timeout_s must be positive, got {self.timeout_s}")


class TPGroup:
    """A formed group: this process's rank, its device, its place in the TP x PP layout
    and the process groups."""

    def __init__(
        self,
        spec: TPGroupSpec,
        device: torch.device,
        backend: str,
        cpu_group: dist.ProcessGroup,
        tp_process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = spec.rank
        """The global rank (0 drives the engine)."""
        self.world_size = spec.world_size
        self.layout = ParallelLayout(spec.world_size // spec.pp_size, spec.pp_size)
        self.tp_rank = self.layout.tp_rank(spec.rank)
        self.tp_size = self.layout.tp_size
        self.pp_rank = self.layout.pp_rank(spec.rank)
        self.pp_size = spec.pp_size
        self.tp_process_group = tp_process_group
        """This stage's device subgroup for the tensor-parallel collectives; None: the
        default group (one stage)."""
        self.device = device
        self.backend = backend
        """'nccl' or 'gloo': the backend of the device collectives."""
        self.cpu_group = cpu_group
        """A gloo group over the same ranks, for host-side messages."""
        self.timeout_s = spec.timeout_s
        self._is_open = True

    def close(self) -> None:
        if self._is_open and dist.is_initialized():
            dist.destroy_process_group()
        self._is_open = False

    def __enter__(self) -> TPGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def init_tp_group(spec: TPGroupSpec) -> TPGroup:
    """Join the group described by `spec` (blocks until every rank has joined, or fails
    after spec.timeout_s)."""
    apply_worker_env()
    if dist.is_initialized():
        raise TPGroupError("this process already belongs to a process group")
    device = torch.device(spec.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=spec.timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(spec, device, backend, cpu_group, _stage_subgroup(spec, timeout))


def _stage_subgroup(spec: TPGroupSpec, timeout: timedelta) -> dist.ProcessGroup | None:
    """This rank's stage's device group, when there are several stages of several ranks.
    Every rank creates every stage's group, in the same order (new_group is collective)."""
    layout = ParallelLayout(spec.world_size // spec.pp_size, spec.pp_size)
    if spec.pp_size == 1 or layout.tp_size == 1:
        return None
    own = None
    for pp_rank in range(spec.pp_size):
        subgroup = dist.new_group(layout.stage_ranks(pp_rank), timeout=timeout)
        if pp_rank == layout.pp_rank(spec.rank):
            own = subgroup
    return own


def file_rendezvous(directory: str | None = None) -> str:
    """A fresh 'file://' rendezvous in `directory` (the system temp dir by default)."""
    path = os.path.join(directory or tempfile.gettempdir(), f"tandem-tp-{uuid.uuid4().hex}")
    return f"file://{path}"


def tcp_rendezvous(host: str = "127.0.0.1", port: int = 0) -> str:
    """A 'tcp://' rendezvous; port 0 picks a port that is free now."""
    if port == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
    return f"tcp://{host}:{port}"


def min_over_ranks(value: int, group: TPGroup) -> int:
    """The smallest of every rank's `value` (on the host-message group; every rank calls)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(tensor.item())


def set_collective_timeout(group: TPGroup, timeout_s: float) -> None:
    """From now on a collective of `group` (every process group) fails after `timeout_s`
    instead of the timeout it was formed with: a long one covers the startup, where ranks
    load and compile at different speeds, a shorter one the steps. Best effort: a torch
    without the setter keeps the formation timeout."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return
    timeout = timedelta(seconds=timeout_s)
    subgroups = [] if group.tp_process_group is None else [group.tp_process_group]
    for process_group in (None, group.cpu_group, *subgroups):
        setter(timeout, process_group)
    group.timeout_s = timeout_s
