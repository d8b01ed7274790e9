"""Which prefix cache describes a worker's KV tensors, and when a core may go on with an
earlier core's.

An engine core keeps one KV cache manager for its life; the offline `LLM` builds a core per
`generate` call and hands each the prefix cache of the call before (its KV cache manager and
the offload tiers behind it), so that a later call hits what an earlier one filled (a
conversation's next turn, a shared few-shot prefix), as vLLM's LLM does. Several engines
may share one loaded worker (`LLM(reuse=...)`, the benchmarks, the tests), and any of them
rewrites the worker's KV blocks and starts its host pool over: a kept cache still holds what
it published only if no other core ran on the worker since. Each core claims the worker's
KV tensors for its manager when it is built; a kept cache whose manager was not the last to
claim them is dropped, and the new core starts empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.kv_offload_setup import OffloadTiers
from actors.protocol.config import EngineConfig

_LAST_CLAIM: WeakKeyDictionary[object, KVCacheManager] = WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class KeptPrefixCache:
    """A core's prefix cache, for the next core on the same worker."""

    kv: KVCacheManager
    offload_tiers: OffloadTiers | None


def claim_kv_tensors(worker: object, kv: KVCacheManager) -> None:
    """`kv` now allocates the worker's KV blocks."""
    _LAST_CLAIM[worker] = kv


def take_kept(
    worker: object, kept: KeptPrefixCache | None, num_blocks: int, config: EngineConfig
) -> KeptPrefixCache | None:
    """`kept` where a new core with `config` can go on with it: its manager was the last to
    claim the worker, it has the same pool and caching options, the same tiers (on or
    off), and no request holds a block (a call that failed part-way may have left some);
    else None."""
    if kept is None or _LAST_CLAIM.get(worker) is not kept.kv:
        return None
    kv, usage = kept.kv, kept.kv.stats()
    fits = (
        usage.num_total_blocks == num_blocks
        and kv.block_size == config.block_size
        and kv.enable_prefix_caching == config.enable_prefix_caching
        and kv.cache_outputs == config.prefix_caching_outputs
        and (kept.offload_tiers is not None) == bool(config.kv_offload_cpu_bytes)
        and usage.num_used_blocks == 0
    )
    return kept if fits else None
