"""Which engine core a request goes to, when `tandem serve --data-parallel-size N` runs N
cores behind each API server.

Load: a core's running plus waiting requests as it last reported them (every step's
outputs and every heartbeat carry its CoreLoad, as vLLM's engines report theirs), plus
the requests this API server sent it that the core had not yet taken in when it reported
(the report counts those it took in: requests still in its socket or mailbox are in
neither count, and a burst would otherwise pile onto one core between reports).

Prefix affinity: each request's prompt prefixes are recorded against the core it went to
(actors/frontend/prefix_affinity.py); a core then "holds" the leading blocks of a new
prompt that it was sent before, and a conversation's next turn (its earlier turns are its
prefix) finds the core whose prefix cache has them.

The rule, per request:

1. each core's cost is its load, in requests, less a credit for the leading blocks of the
   prompt it holds beyond the fewest any core holds: one request per
   AFFINITY_TOKENS_PER_REQUEST (64) such tokens, but at most AFFINITY_SLACK_REQUESTS +
   AFFINITY_SLACK_FRACTION x the least load (2 requests at an idle server, 7 when the
   least loaded core has 20);
2. the cheapest core wins; among equals the one with the larger credit, then the next in
   turn (each API server starts its turns at its own index, so idle servers do not all
   pick core 0).

So a prefix every core holds steers nothing, a short one shared by many requests (a
16-token system prompt: a quarter of a request) hardly does and a burst spreads evenly,
while a conversation stays on the core that holds its earlier turns until that core is
busier than its cached prefix is worth (a 256-token history: 2 requests more at an idle
server), and never more than the cap above the least loaded core.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.frontend.prefix_affinity import MAX_CORES, PrefixAffinity, prefix_hashes
from actors.protocol.messages import CoreLoad

AFFINITY_TOKENS_PER_REQUEST = 64
"""Cached prompt tokens worth one more request of load on their core."""
AFFINITY_SLACK_REQUESTS = 2
AFFINITY_SLACK_FRACTION = 0.25


def affinity_slack(least_load: int) -> int:
    """The most requests a prefix's credit is worth: how much busier than the least loaded
    core a core that holds it may be and still be chosen."""
    return AFFINITY_SLACK_REQUESTS + int(AFFINITY_SLACK_FRACTION * least_load)


class DataParallelBalancer:
    """Pure bookkeeping (no I/O): `choose` per request, `report` per core load heard."""

    def __init__(
        self,
        num_cores: int,
        block_size: int,
        affinity: PrefixAffinity | None = None,
        *,
        first_turn: int = 0,
    ) -> None:
        if not 1 <= num_cores <= MAX_CORES:
            raise ValueError(f"num_cores must be in [1, {MAX_CORES}], got {num_cores}")
        self.num_cores = num_cores
        self.block_size = block_size
        self.affinity = affinity if affinity is not None else PrefixAffinity()
        self._reported = [0] * num_cores
        self._received = [0] * num_cores
        self._sent = [0] * num_cores
        self._turn = first_turn % num_cores

    def loads(self) -> list[int]:
        """Each core's running and waiting requests, those on their way to it included."""
        return [
            reported + max(0, sent - received)
            for reported, sent, received in zip(self._reported, self._sent, self._received)
        ]

    def report(self, core: int, load: CoreLoad) -> None:
        """Core `core` says how busy it is now."""
        self._reported[core] = load.num_running + load.num_waiting
        self._received[core] = load.num_received

    def choose(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The core for a request with this prompt; counted as sent to it."""
        if self.num_cores == 1:
            core = 0
        else:
            hashes = prefix_hashes(prompt_token_ids, self.block_size, cache_salt)
            matched = self.affinity.matched_blocks(hashes, self.num_cores)
            core = self._pick(self.loads(), matched)
            self.affinity.record(hashes, core)
        self._sent[core] += 1
        return core

    def _pick(self, loads: list[int], matched: list[int]) -> int:
        """Costs in tokens (a request of load is AFFINITY_TOKENS_PER_REQUEST tokens)."""
        per_request = AFFINITY_TOKENS_PER_REQUEST
        cap = affinity_slack(min(loads)) * per_request
        fewest = min(matched)
        credit = [min(cap, (m - fewest) * self.block_size) for m in matched]
        cost = [load * per_request - c for load, c in zip(loads, credit)]
        cheapest = min(cost)
        top_credit = max(credit[c] for c in range(self.num_cores) if cost[c] == cheapest)
        tied = {c for c in range(self.num_cores) if (cost[c], credit[c]) == (cheapest, top_credit)}
        for offset in range(self.num_cores):
            core = (self._turn + offset) % self.num_cores
            if core in tied:
                self._turn = (core + 1) % self.num_cores
                return core
        raise AssertionError("no core was cheapest")  # unreachable
