"""actors/core/kv_claims.py: a kept KV cache manager keeps its cached blocks only while no
other manager ran on the worker, and fits a new core only with the same pool and options
and no block held (the offline LLM end to end: tests/app/test_llm_prefix_cache.py)."""

from __future__ import annotations

import numpy as np

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.kv_claims import claim_kv_tensors, reusable
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


def test_a_manager_keeps_its_cache_while_it_was_the_last_on_the_worker() -> None:
    worker, kv = _Worker(), KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    claim_kv_tensors(worker, kv)  # an LLM's first call
    _cache_blocks(kv)
    claim_kv_tensors(worker, kv)  # its next call
    assert kv.stats().num_cached_blocks == 2
    other = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    claim_kv_tensors(worker, other)  # another engine wrote the blocks
    claim_kv_tensors(worker, kv)
    assert kv.stats().num_cached_blocks == 0
    kv.check_invariants()


def test_a_manager_is_kept_only_where_it_fits() -> None:
    kv = _cache_blocks(KVCacheManager(NUM_BLOCKS, BLOCK_SIZE))
    assert reusable(kv, NUM_BLOCKS, CONFIG)
    assert not reusable(kv, NUM_BLOCKS - 1, CONFIG)  # another pool size
    assert not reusable(kv, NUM_BLOCKS, CONFIG.replace(prefix_caching_outputs=False))
    assert not reusable(kv, NUM_BLOCKS, CONFIG.replace(enable_prefix_caching=False))
    assert not reusable(kv, NUM_BLOCKS, CONFIG.replace(kv_offload_cpu_bytes=1 << 30))
    kv.pool.allocate(1)  # as if a failed call left a request's block behind
    assert not reusable(kv, NUM_BLOCKS, CONFIG)
