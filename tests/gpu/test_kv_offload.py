"""The worker's host pool (gpu/kv_offload.py) on the CPU: a block saved to a host slot and
loaded into another device block holds the same bytes, in every layer, K and V; spills go
to the disk writer and fills come back; loads report when they are done; the same code runs
on CUDA with a side stream, where the step's forward waits for its saves, and for loads
only when its transfer names them."""

from __future__ import annotations

import time

import pytest
import torch

from actors.protocol.messages import KVTransfer
from gpu.attention.base import allocate_kv_cache
from gpu.kv_offload import HostKVPool, attach_host_pool, kv_loads_done_through, run_kv_transfer

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 3, 6, 4, 2, 8


def _random_caches(dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    caches = allocate_kv_cache(
        NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype, device
    )
    generator = torch.Generator().manual_seed(0)
    for layer in caches:
        layer.copy_(torch.randn(layer.shape, generator=generator).to(dtype))
    return caches


def _block(caches: list[torch.Tensor], block_id: int) -> list[torch.Tensor]:
    return [layer[:, block_id].clone() for layer in caches]


class _Writer:
    def __init__(self) -> None:
        self.files: dict[bytes, bytes] = {}

    def write(self, block_hash: bytes, data: bytes) -> None:
        self.files[block_hash] = data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_save_then_load_gives_identical_kv_bytes(dtype: torch.dtype) -> None:
    caches = _random_caches(dtype)
    pool = HostKVPool(caches, num_slots=4, pin_memory=False)
    originals = {block_id: _block(caches, block_id) for block_id in (1, 4)}
    pool.apply(KVTransfer(save_gpu_block_ids=(1, 4), save_host_slots=(2, 0)))
    for layer in caches:  # the device blocks are reused for something else
        layer[:, 1].zero_()
        layer[:, 4].zero_()
    untouched = _block(caches, 3)
    pool.apply(KVTransfer(load_host_slots=(2, 0), load_gpu_block_ids=(5, 3)))
    for expected, actual in zip(originals[1], _block(caches, 5), strict=True):
        assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8))
    for expected, actual in zip(originals[4], _block(caches, 3), strict=True):
        assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8))
    assert not all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(untouched, _block(caches, 3), strict=True)
    )


def test_a_spilled_slot_is_written_before_the_same_step_saves_over_it() -> None:
    caches = _random_caches(torch.float32)
    writer = _Writer()
    pool = HostKVPool(caches, num_slots=2, pin_memory=False, disk=writer)
    pool.apply(KVTransfer(save_gpu_block_ids=(0,), save_host_slots=(1,)))
    block_0 = pool.slot_bytes(1)
    pool.apply(
        KVTransfer(
            spill_host_slots=(1,),
            spill_hashes=(b"h0",),
            save_gpu_block_ids=(2,),
            save_host_slots=(1,),
        )
    )
    assert writer.files == {b"h0": block_0}
    assert pool.slot_bytes(1) != block_0


def test_a_fill_then_load_restores_a_spilled_block() -> None:
    caches = _random_caches(torch.float32)
    writer = _Writer()
    pool = HostKVPool(caches, num_slots=2, pin_memory=False, disk=writer)
    expected = _block(caches, 0)
    pool.apply(KVTransfer(save_gpu_block_ids=(0,), save_host_slots=(0,)))
    pool.apply(KVTransfer(spill_host_slots=(0,), spill_hashes=(b"h",)))
    pool.apply(
        KVTransfer(
            fill_host_slots=(1,),
            fill_data=(writer.files[b"h"],),
            load_host_slots=(1,),
            load_gpu_block_ids=(4,),
        )
    )
    for want, got in zip(expected, _block(caches, 4), strict=True):
        assert torch.equal(want, got)


def test_a_worker_without_a_host_pool_refuses_copies() -> None:
    class Worker:
        kv_offload = None

    run_kv_transfer(Worker(), None)  # no copies: nothing to do
    with pytest.raises(RuntimeError, match="no host pool"):
        run_kv_transfer(Worker(), KVTransfer(save_gpu_block_ids=(0,), save_host_slots=(0,)))


def test_every_step_passes_through_the_pool_with_or_without_copies() -> None:
    class Worker:
        pass

    worker = Worker()
    caches = _random_caches(torch.float32)
    attach_host_pool(worker, caches, 2, pin_memory=False, disk=None)
    expected = _block(caches, 1)
    run_kv_transfer(worker, KVTransfer(save_gpu_block_ids=(1,), save_host_slots=(0,)))
    assert kv_loads_done_through(worker) == -1
    load = KVTransfer(load_host_slots=(0,), load_gpu_block_ids=(4,), load_id=0)
    run_kv_transfer(worker, load)
    assert kv_loads_done_through(worker) == 0  # on the CPU a load is done when it returns
    for want, got in zip(expected, _block(caches, 4), strict=True):
        assert torch.equal(want, got)


def test_a_reused_pool_counts_loads_from_the_start_again() -> None:
    """A new engine core numbers its loads from 0: the pool it reuses must not report the
    earlier core's (a stale report would release a request before its loads)."""

    class Worker:
        pass

    worker = Worker()
    caches = _random_caches(torch.float32)
    attach_host_pool(worker, caches, 2, pin_memory=False, disk=None)
    run_kv_transfer(worker, KVTransfer(save_gpu_block_ids=(1,), save_host_slots=(0,)))
    for load_id in range(3):
        run_kv_transfer(
            worker, KVTransfer(load_host_slots=(0,), load_gpu_block_ids=(4,), load_id=load_id)
        )
    assert kv_loads_done_through(worker) == 2
    attach_host_pool(worker, caches, 2, pin_memory=False, disk=None)
    assert kv_loads_done_through(worker) == -1


def test_attach_reuses_a_pool_of_the_same_size() -> None:
    class Worker:
        pass

    worker = Worker()
    caches = _random_caches(torch.float32)
    first = attach_host_pool(worker, caches, 3, pin_memory=False, disk=None)
    assert attach_host_pool(worker, caches, 3, pin_memory=False, disk=None) is first
    assert attach_host_pool(worker, caches, 4, pin_memory=False, disk=None) is not first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_round_trip_on_cuda_through_pinned_memory() -> None:
    caches = _random_caches(torch.bfloat16, "cuda")
    pool = HostKVPool(caches, num_slots=4, pin_memory=True)
    assert pool.pinned
    expected = _block(caches, 2)
    pool.apply(KVTransfer(save_gpu_block_ids=(2,), save_host_slots=(3,)))
    for layer in caches:  # queued after the save on the compute stream
        layer[:, 2].zero_()
    pool.apply(KVTransfer(load_host_slots=(3,), load_gpu_block_ids=(5,)))
    torch.cuda.synchronize()
    for want, got in zip(expected, _block(caches, 5), strict=True):
        assert torch.equal(want, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("wait", ["same step", "later step", "reported"])
def test_on_cuda_a_load_is_ordered_before_the_step_that_reads_it(wait: str) -> None:
    """A reader queued on the compute stream sees the loaded block once a transfer named
    the load in `wait_loads_through` (its own step's or a later one without copies), or
    once the pool reported it done."""
    caches = _random_caches(torch.float32, "cuda")
    pool = HostKVPool(caches, num_slots=4, pin_memory=True)
    expected = _block(caches, 2)
    pool.apply(KVTransfer(save_gpu_block_ids=(2,), save_host_slots=(1,)))
    torch.cuda.synchronize()
    same_step = 0 if wait == "same step" else -1
    pool.apply(
        KVTransfer(
            load_host_slots=(1,), load_gpu_block_ids=(5,), load_id=0, wait_loads_through=same_step
        )
    )
    if wait == "later step":
        pool.apply(KVTransfer(wait_loads_through=0))
    elif wait == "reported":
        deadline = time.monotonic() + 10
        while pool.loads_done_through() < 0:
            assert time.monotonic() < deadline, "the load never reported done"
    got = _block(caches, 5)  # queued on the compute stream
    torch.cuda.synchronize()
    for want, actual in zip(expected, got, strict=True):
        assert torch.equal(want, actual)
    assert pool.loads_done_through() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_saved", [1, 40, 70])  # one, two and three staging chunks
def test_on_cuda_blocks_rewritten_right_after_their_save_reach_the_host_intact(
    num_saved: int,
) -> None:
    """The step's forward waits for the saves' gathers only, not for their copies over
    PCIe: blocks rewritten on the compute stream right after `apply` still arrive whole."""
    caches = allocate_kv_cache(
        NUM_LAYERS, 80, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, torch.bfloat16, "cuda"
    )
    for layer in caches:
        layer.copy_(torch.randn(layer.shape, device="cuda").to(torch.bfloat16))
    pool = HostKVPool(caches, num_slots=num_saved, pin_memory=True)
    block_ids = tuple(range(5, 5 + num_saved))
    expected = [_block(caches, block_id) for block_id in block_ids]
    pool.apply(KVTransfer(save_gpu_block_ids=block_ids, save_host_slots=tuple(range(num_saved))))
    for layer in caches:  # the next step's forward, queued at once
        layer.mul_(-1.0)
    for slot, want in enumerate(expected):
        host = torch.frombuffer(bytearray(pool.slot_bytes(slot)), dtype=torch.bfloat16)
        assert torch.equal(host, torch.stack(want).cpu().flatten())
