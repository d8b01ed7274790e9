"""Where each rank of a TP x PP engine sits: its pipeline stage, its tensor-parallel rank,
and the layers its stage runs.

Ranks are numbered stage-major: rank = pp_rank * tp_size + tp_rank, so rank 0 (the
engine core's own rank) is tensor-parallel rank 0 of the first stage, and the ranks of
one stage are neighbours (one host's GPUs cuda:0.. in order). Tensor-parallel rank t of
stage s sends its activations to rank t of stage s + 1: every rank of a stage holds the
whole hidden state after the stage's last all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    tp_size: int
    pp_size: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(
                f"tp_size and pp_size must be at least 1, got {self.tp_size}, {self.pp_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The ranks of one stage (one tensor-parallel group)."""
        return [self.rank_of(pp_rank, t) for t in range(self.tp_size)]


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers stage `pp_rank` of `pp_size` runs: contiguous, every layer once,
    sizes differing by at most one, the extra layers on the earliest stages (the last
    stage also runs the final norm, the LM head and sampling)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))
