"""Which KV cache manager's bookkeeping describes a worker's KV tensors.

An engine core keeps one KV cache manager for its life; the offline `LLM` builds a core per
`generate` call and hands each the manager of the call before, so that a later call hits the
prefix cache that an earlier one filled (a conversation's next turn, a shared few-shot
prefix), as vLLM's LLM does. Several engines may share one loaded worker (`LLM(reuse=...)`,
the benchmarks, the tests), and any of them rewrites the worker's KV blocks: a manager's
cached blocks still hold what it published only if no other manager ran on the worker
since. Each core claims the worker's KV tensors for its manager when it is built; a
returning manager that was not the last to claim them forgets every cached block.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from actors.core.kv_cache_manager import KVCacheManager
from actors.protocol.config import EngineConfig

_LAST_CLAIM: WeakKeyDictionary[object, KVCacheManager] = WeakKeyDictionary()


def claim_kv_tensors(worker: object, kv: KVCacheManager) -> None:
    """`kv` is about to allocate the worker's KV blocks: it drops its cached blocks unless it
    was the last manager to run on this worker."""
    if _LAST_CLAIM.get(worker) is not kv:
        kv.reset_prefix_cache()
    _LAST_CLAIM[worker] = kv


def reusable(kv: KVCacheManager, num_blocks: int, config: EngineConfig) -> bool:
    """Whether a kept manager fits a new core: the same pool and caching options, no
    offload tiers (their host memory belongs to the core that made them), and no request
    holding a block (a call that failed part-way may have left some)."""
    usage = kv.stats()
    return (
        usage.num_total_blocks == num_blocks
        and kv.block_size == config.block_size
        and kv.enable_prefix_caching == config.enable_prefix_caching
        and kv.cache_outputs == config.prefix_caching_outputs
        and kv.offload is None
        and not config.kv_offload_cpu_bytes
        and usage.num_used_blocks == 0
    )
