"""actors/core/kv_claims.py: a new core goes on with a kept prefix cache only while no other
manager ran on the worker since, with the same pool, options and tiers, and no block held
(the offline LLM end to end: tests/app/test_llm_prefix_cache.py)."""

from __future__ import annotations

import numpy as np

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.kv_claims import KeptPrefixCache, claim_kv_tensors, take_kept
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.config import EngineConfig
from actors.protocol.messages import StepOutput, StepStats
from tests.actors._kv_helpers import engine_request

BLOCK_SIZE = 16
NUM_BLOCKS = 32
CONFIG = EngineConfig(model="default", block_size=BLOCK_SIZE)


class _Worker:
    """Stands for a loaded model whose KV tensors several engines share."""


def _cache_blocks(kv: KVCacheManager, num_tokens: int = 40) -> KVCacheManager:
    """`kv` after one finished request left num_tokens // 16 blocks cached."""
    config = SchedulerConfig(
        max_num_seqs=2,
        max_num_batched_tokens=256,
        max_model_len=256,
        block_size=BLOCK_SIZE,
        max_steps_in_flight=1,
    )
    scheduler = Scheduler(config, kv)
    scheduler.add_request(engine_request("r", tuple(range(num_tokens)), max_tokens=1))
    out = scheduler.schedule()
    assert out is not None
    result = StepOutput(
        step_id=out.step_id,
        request_ids=("r",),
        sampled_token_ids=np.asarray([1], np.int64),
        logprobs=None,
        stats=StepStats(out.step_id, 1, 0, 0),
    )
    scheduler.update_from_step(result)
    scheduler.free_finished_blocks()
    assert kv.stats().num_cached_blocks == num_tokens // BLOCK_SIZE
    return kv


def test_a_kept_cache_is_taken_only_while_its_manager_was_the_last_on_the_worker() -> None:
    worker, kv = _Worker(), KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    claim_kv_tensors(worker, kv)  # an LLM's first call
    _cache_blocks(kv)
    kept = KeptPrefixCache(kv, None)
    assert take_kept(worker, kept, NUM_BLOCKS, CONFIG) is kept  # its next call
    assert take_kept(worker, None, NUM_BLOCKS, CONFIG) is None
    claim_kv_tensors(worker, KVCacheManager(NUM_BLOCKS, BLOCK_SIZE))  # another engine ran
    assert take_kept(worker, kept, NUM_BLOCKS, CONFIG) is None
    assert take_kept(_Worker(), kept, NUM_BLOCKS, CONFIG) is None  # another model


def test_a_kept_cache_is_taken_only_where_it_fits() -> None:
    worker, kv = _Worker(), KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    claim_kv_tensors(worker, kv)
    kept = KeptPrefixCache(_cache_blocks(kv), None)
    assert take_kept(worker, kept, NUM_BLOCKS, CONFIG) is kept
    for num_blocks, config in [
        (NUM_BLOCKS - 1, CONFIG),  # another pool size
        (NUM_BLOCKS, CONFIG.replace(prefix_caching_outputs=False)),
        (NUM_BLOCKS, CONFIG.replace(enable_prefix_caching=False)),
        (NUM_BLOCKS, CONFIG.replace(kv_offload_cpu_bytes=1 << 30)),  # tiers it lacks
    ]:
        assert take_kept(worker, kept, num_blocks, config) is None
    kv.pool.allocate(1)  # as if a failed call left a request's block behind
    assert take_kept(worker, kept, NUM_BLOCKS, CONFIG) is None
