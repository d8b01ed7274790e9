"""Requests held while their prefix is loaded from the offload tiers, so the loads overlap
other requests' steps instead of stalling them.

A prompt whose next blocks are in host memory gets device blocks for them, loaded beside
the step being built; the worker starts the loads on a side stream and reports, with each
step's output, which loads are done (gpu/kv_offload.py). No row may read those blocks before
then: the request (and any other whose device hits include a block still loading) is
*held*. It keeps its blocks and its place in the waiting queue but gets no grant; each
allocation that reaches it holds it again while its loads run and grants it within the
blocks it holds once they are done, or, when the allocation does not reach it (too little
budget, a preemption), releases its blocks, which stay cached with their loaded KV (still
marked loading until done), and it is admitted later like any waiting request. So held
blocks never starve a preempted or higher-priority request, and the scheduler never sees a
held request: it stays waiting until granted. An abort frees its blocks like any other
request's; a step that reuses a block still loading waits for the load.

When nothing else would run in the step (no running row and no other grant), there is
nothing to overlap: the held requests are granted at once and the step's forward waits for
every load (KVTransfer.wait_loads_through).

A request whose next blocks are on disk is not admitted while the disk store's reader thread
reads them (the entries after it go first); once they are in host memory it is admitted as a
host hit, held like any. It waits for reads once: at its later tries it waits for the
reads still in flight but starts no more, so it cannot chase blocks that its own fills, or
others', pushed out of host memory meanwhile.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from actors.core.kv_offload import KVOffload, Lookup
from actors.core.prefix_hash import BlockHash


class Holds:
    """Held request ids -> their cached tokens (the hits and loaded blocks they hold)."""

    def __init__(self) -> None:
        self._num_cached_tokens: dict[str, int] = {}
        self._counted: dict[str, tuple[int, int]] = {}
        """Held request ids -> the (queried, hit) prefix-cache tokens their admission found,
        counted when the request is granted (a hold released ungranted counts nothing: its
        next admission looks again)."""
        self._waited_for_reads: set[str] = set()
        """Waiting requests that have waited for disk reads once."""

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._num_cached_tokens

    def __len__(self) -> int:
        return len(self._num_cached_tokens)

    def hold(
        self, request_id: str, num_cached_tokens: int, counted: tuple[int, int] = (0, 0)
    ) -> None:
        self._num_cached_tokens[request_id] = num_cached_tokens
        self._counted[request_id] = counted

    def pop(self, request_id: str) -> int:
        self._counted.pop(request_id, None)
        return self._num_cached_tokens.pop(request_id)

    def move(self, request_id: str, to: Holds) -> None:
        """Hold the request in `to` instead, with what its admission counted."""
        to.hold(request_id, self._num_cached_tokens[request_id], self.counted(request_id))
        self.pop(request_id)

    def counted(self, request_id: str) -> tuple[int, int]:
        """The (queried, hit) tokens the request's admission found."""
        return self._counted.get(request_id, (0, 0))

    def discard(self, request_id: str) -> None:
        self._num_cached_tokens.pop(request_id, None)
        self._counted.pop(request_id, None)
        self._waited_for_reads.discard(request_id)

    def lookup(
        self, offload: KVOffload | None, request_id: str, hashes: Sequence[BlockHash]
    ) -> Lookup | None:
        """`offload.lookup` for a waiting request (the blocks after the device pool's hits
        that host memory holds, up to the first it misses; None while some are read from
        disk), which starts disk reads only the first time it must wait for some."""
        if offload is None:
            return Lookup()
        waited = self._waited_for_reads
        lookup = offload.lookup(hashes, start_reads=request_id not in waited)
        if lookup is None:
            waited.add(request_id)
        else:
            waited.discard(request_id)
        return lookup

    def take(self) -> Holds:
        """Every hold, moved out (an allocation grants or releases each of them); the
        requests that waited for reads stay."""
        taken = Holds()
        taken._num_cached_tokens, self._num_cached_tokens = self._num_cached_tokens, {}
        taken._counted, self._counted = self._counted, {}
        return taken

    def request_ids(self) -> list[str]:
        return list(self._num_cached_tokens)

    def check_invariants(self, holders: Container[str]) -> None:
        lost = [r for r in self._num_cached_tokens if r not in holders]
        if lost:
            raise AssertionError(f"held requests without blocks: {lost}")
