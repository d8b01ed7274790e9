"""What each rank runs in the tensor-parallel tests (spawned processes import this module,
so everything here is a module-level function of picklable arguments)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actors.protocol.sampling_params import SamplingParams
from gpu.attention.base import allocate_kv_cache
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.distributed.communicator import Communicator
from gpu.distributed.group import TPGroupSpec, init_tp_group
from gpu.distributed.pipeline import PipelineStage
from gpu.distributed.step_broadcast import StepBroadcaster
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.models.parallel_layers import (
    all_gather_tokens,
    reduce_scatter_tokens,
    token_shard,
    vocab_shard,
)
from gpu.sampling.batch_shard import AllGatherSampler, BatchShardedSampler, to_owner_major
from gpu.sampling.sampler import Sampler, SamplerOutput
from gpu.sampling.state import SamplingState
from gpu.weights.dummy import dummy_weights
from gpu.weights.shard_layout import ShardSlice, take_shard
from gpu.weights.shard_loader import load_weight_shard
from tests.gpu._paged_kv_batch import PagedKVBook

GROUP_TIMEOUT_S = 60.0
EOS = 7


def _spec(
    rank: int,
    world_size: int,
    init_method: str,
    timeout_s: float = GROUP_TIMEOUT_S,
    device_kind: str = "cpu",
) -> TPGroupSpec:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    return TPGroupSpec(rank, world_size, init_method, device, timeout_s)


# ---- the model ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GreedyRun:
    prompt_logits: torch.Tensor  # [num_prompts, vocab] float32, last prompt token
    tokens: torch.Tensor  # [num_prompts, num_steps] int64, greedy continuations


def run_greedy(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    prompts: list[list[int]],
    num_steps: int,
    tp: Communicator | None = None,
    device: str = "cpu",
    sequence_parallel: bool = False,
) -> GreedyRun:
    """Prefill `prompts` in one varlen batch, then decode greedily; with `tp`, tokens come
    from batch-sharded sampling of the local logits. Results come back on the CPU."""
    model = DecoderModel(
        config,
        TorchAttentionBackend(),
        torch.float32,
        device,
        tp,
        sequence_parallel=sequence_parallel,
    )
    model.load_weights(weights)
    kv_caches = allocate_kv_cache(
        config.num_layers, 64, 8, model.num_kv_heads, config.head_dim, torch.float32, device
    )
    book = PagedKVBook(num_blocks=64, block_size=8, seed=1)
    state = SamplingState(len(prompts), config.vocab_size, device)
    for row in range(len(prompts)):
        state.add_request(row, SamplingParams(temperature=0.0), prompts[row], [], [], 0)
    sampler = Sampler(state) if tp is None else BatchShardedSampler(Sampler(state), tp)
    rows = np.arange(len(prompts), dtype=np.int32)
    step = [(f"r{i}", len(p)) for i, p in enumerate(prompts)]
    input_ids = torch.tensor([t for p in prompts for t in p], device=device)
    prompt_logits, tokens = None, []
    with torch.inference_mode():
        for _ in range(num_steps + 1):
            positions, metadata = book.step(step, device=device)
            hidden = model(input_ids, positions, kv_caches, metadata)
            last = torch.from_numpy(metadata.query_start_loc_cpu[1:] - 1).long().to(device)
            if prompt_logits is None:
                prompt_logits = model.compute_logits(hidden[last]).cpu()
            if tp is not None:
                last = last[sampler.logits_row_order(len(prompts))]
            local = model.compute_logits_local(hidden[last]).float()
            sampled = sampler(
                local,
                torch.from_numpy(rows).to(device),
                rows,
                positions[last] + 1,
                torch.zeros(len(rows), dtype=torch.int32, device=device),
                None,
            ).sampled_token_ids
            tokens.append(sampled.cpu())
            step, input_ids = [(f"r{i}", 1) for i in range(len(prompts))], sampled
    return GreedyRun(prompt_logits, torch.stack(tokens[:num_steps], dim=1))


def dummy_model_rank(
    rank: int,
    world_size: int,
    init_method: str,
    cases: list[tuple[ModelConfig, list[list[int]], int]],
    device_kind: str = "cpu",
) -> list[GreedyRun]:
    with init_tp_group(_spec(rank, world_size, init_method, device_kind=device_kind)) as group:
        comm, device = Communicator(group), str(group.device)
        return [
            run_greedy(
                config,
                dummy_weights(
                    config, torch.float32, device, seed=5, tp_rank=rank, tp_size=world_size
                ),
                prompts,
                num_steps,
                comm,
                device,
            )
            for config, prompts, num_steps in cases
        ]


def sequence_parallel_rank(
    rank: int,
    world_size: int,
    init_method: str,
    cases: list[tuple[ModelConfig, list[list[int]], int]],
) -> list[tuple[GreedyRun, GreedyRun]]:
    """(without, with sequence parallelism) per case, on the same weights and group."""
    with init_tp_group(_spec(rank, world_size, init_method)) as group:
        comm, runs = Communicator(group), []
        for config, prompts, num_steps in cases:
            weights = dummy_weights(
                config, torch.float32, "cpu", seed=5, tp_rank=rank, tp_size=world_size
            )
            without, with_sp = (
                run_greedy(config, weights, prompts, num_steps, comm, sequence_parallel=sp)
                for sp in (False, True)
            )
            runs.append((without, with_sp))
        return runs


PipelineStep = tuple[list[tuple[str, list[int]]], int]
"""((request, its new token ids) per request, padding tokens) of one step."""


def pipeline_sequence_parallel_rank(
    rank: int,
    world_size: int,
    init_method: str,
    config: ModelConfig,
    steps: list[PipelineStep],
) -> list[list[torch.Tensor]] | None:
    """Two pipeline stages of world_size / 2 TP ranks: on the last stage, the logits
    [num_actual_tokens, vocab] of each step without and with sequence parallelism; None
    on the first."""
    spec = TPGroupSpec(rank, world_size, init_method, "cpu", GROUP_TIMEOUT_S, pp_size=2)
    with init_tp_group(spec) as group:
        stage, comm = PipelineStage(group, config), Communicator(group)
        weights = dummy_weights(
            config, torch.float32, "cpu", 5, group.tp_rank, group.tp_size, stage.holds_weight
        )
        runs = []
        for sp in (False, True):
            backend = TorchAttentionBackend()
            model = DecoderModel(
                config, backend, torch.float32, "cpu", comm, pp=stage, sequence_parallel=sp
            )
            model.load_weights(weights)
            kv_caches = allocate_kv_cache(
                len(model.layers), 64, 8, model.num_kv_heads, config.head_dim, torch.float32, "cpu"
            )
            book, logits = PagedKVBook(num_blocks=64, block_size=8, seed=1), []
            with torch.inference_mode():
                for new_ids, num_padding in steps:
                    positions, metadata = book.step([(r, len(i)) for r, i in new_ids], num_padding)
                    ids = [t for _, i in new_ids for t in i]
                    hidden = model(
                        torch.tensor(ids + [0] * num_padding), positions, kv_caches, metadata
                    )
                    if stage.is_last:
                        logits.append(model.compute_logits(hidden[: len(ids)]))
            runs.append(logits)
        return runs if stage.is_last else None


def model_file_rank(
    rank: int,
    world_size: int,
    init_method: str,
    model: str,
    prompts: list[list[int]],
    num_steps: int,
) -> GreedyRun:
    with init_tp_group(_spec(rank, world_size, init_method)) as group:
        shard = load_weight_shard(model, torch.float32, "cpu", rank, world_size)
        return run_greedy(shard.config, shard.weights, prompts, num_steps, Communicator(group))


# ---- sampling -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SamplingCase:
    vocab_size: int
    params_by_row: dict[int, SamplingParams]
    rows: list[int]
    """The batch: one request row per logit row."""
    max_num_logprobs: int | None
    logits_seed: int


def case_inputs(case: SamplingCase, device: str = "cpu") -> tuple[Sampler, torch.Tensor, dict]:
    """The same sampler, logits and call arguments on every rank and in the parent."""
    state = SamplingState(32, case.vocab_size, device)
    for row, params in case.params_by_row.items():
        state.add_request(row, params, [1, 2, 3, row], [4, row], [EOS], 1000 + row)
    generator = torch.Generator().manual_seed(case.logits_seed)
    logits = torch.randn(len(case.rows), case.vocab_size, generator=generator) * 3.0
    rows_np = np.asarray(case.rows, dtype=np.int32)
    num_rows = len(rows_np)
    args = dict(
        idx_mapping_gpu=torch.from_numpy(rows_np).to(device),
        idx_mapping_np=rows_np,
        positions_gpu=torch.arange(100, 100 + num_rows, dtype=torch.int64, device=device) * 7,
        num_output_tokens_gpu=torch.full((num_rows,), 2, dtype=torch.int32, device=device),
        max_num_logprobs=case.max_num_logprobs,
    )
    return Sampler(state), logits.to(device), args


def sampling_rank(
    rank: int,
    world_size: int,
    init_method: str,
    cases: list[SamplingCase],
    device_kind: str = "cpu",
) -> list[tuple[SamplerOutput, SamplerOutput]]:
    """(batch-sharded output, all-gather output) per case, on the CPU."""
    with init_tp_group(_spec(rank, world_size, init_method, device_kind=device_kind)) as group:
        comm = Communicator(group)
        outputs = []
        for case in cases:
            sampler, logits, args = case_inputs(case, str(group.device))
            shard = vocab_shard(case.vocab_size, rank, world_size)
            local = take_shard(
                logits,
                ShardSlice(1, shard.start, shard.start + shard.num_real_rows, shard.num_rows),
            )
            sharded = BatchShardedSampler(sampler, comm)
            owner_major = to_owner_major(local, sharded.plan(len(case.rows)))
            outputs.append(
                (
                    _to_cpu(sharded(owner_major, **args)),
                    _to_cpu(AllGatherSampler(sampler, comm)(local, **args)),
                )
            )
        return outputs


def _to_cpu(output: SamplerOutput) -> SamplerOutput:
    return SamplerOutput(
        *(
            None if t is None else t.cpu()
            for t in (
                output.sampled_token_ids,
                output.logprob_token_ids,
                output.logprobs,
                output.sampled_ranks,
            )
        )
    )


# ---- collectives, step broadcast and failures -----------------------------------------


def collectives_rank(
    rank: int, world_size: int, init_method: str, payloads: list[bytes]
) -> dict[str, object]:
    with init_tp_group(_spec(rank, world_size, init_method)) as group:
        comm = Communicator(group)
        mine = torch.arange(6, dtype=torch.float32).view(3, 2) + 100 * rank
        results: dict[str, object] = {
            "all_reduce": comm.all_reduce(mine.clone()),
            "all_gather": comm.all_gather(mine),
            "all_to_all": comm.all_to_all(torch.arange(2 * world_size) + 100 * rank),
        }
        broadcaster = StepBroadcaster(group, frame_bytes=64)
        if rank == 0:
            for payload in payloads:
                broadcaster.send(payload)
            broadcaster.send_object({"step_id": 3, "request_ids": ["a", "b"]})
            broadcaster.send_shutdown()
            return results
        results["received"] = [broadcaster.recv() for _ in payloads]
        results["object"] = broadcaster.recv_object()
        results["after_shutdown"] = broadcaster.recv()
        return results


def token_collectives_rank(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    """The reduce-scatter and the token-shard helpers, on inputs the test rebuilds."""
    with init_tp_group(_spec(rank, world_size, init_method)) as group:
        comm = Communicator(group)
        mine = torch.arange(4 * world_size, dtype=torch.float32).view(-1, 2) + 100 * rank
        partial = torch.arange(3 * 2 * 5, dtype=torch.float32).view(3, 2, 5) * (rank + 1)
        shard = reduce_scatter_tokens(partial, comm)
        try:
            comm.reduce_scatter(torch.ones(2 * world_size + 1, 2))
            error = ""
        except ValueError as exc:
            error = str(exc)
        return {
            "reduce_scatter": comm.reduce_scatter(mine),
            "reduce_scatter_bf16": comm.reduce_scatter(mine.bfloat16()),
            "token_shard_of_sum": shard,
            "gathered": all_gather_tokens(shard, comm, 3),
            "one_token": all_gather_tokens(reduce_scatter_tokens(partial[:1], comm), comm, 1),
            "token_shard": token_shard(torch.arange(12.0).view(3, 4), comm),
            "uneven_error": error,
        }


def failing_rank(rank: int, world_size: int, init_method: str, mode: str, timeout_s: float) -> None:
    """Rank 1 raises ('raise') or stops answering ('hang'); rank 0 waits in an all-reduce."""
    with init_tp_group(_spec(rank, world_size, init_method, timeout_s)) as group:
        if rank == 1 and mode == "raise":
            raise ValueError("rank 1 gives up")
        if rank == 1 and mode == "hang":
            time.sleep(3600)
        Communicator(group).all_reduce(torch.ones(4))


def late_receiver_rank(
    rank: int, world_size: int, init_method: str, config: ModelConfig, receive_after_s: float
) -> list[int] | None:
    """Two pipeline stages of one rank: the last (the sampler) sends one step's sampled
    table, finishes its sends and leaves the group at once; the first posts its receive
    only after `receive_after_s`, as a rank behind the others does. The tokens the first
    stage received; None on the last."""
    spec = TPGroupSpec(rank, world_size, init_method, "cpu", GROUP_TIMEOUT_S, pp_size=2)
    with init_tp_group(spec) as group:
        stage = PipelineStage(group, config)
        tokens = torch.tensor([11, 12, 13])
        if stage.is_last:
            stage.send_sampled(SamplerOutput(tokens, None, None, None), None)
            stage.finish_sends()
            return None
        time.sleep(receive_after_s)
        receipt = stage.recv_sampled(len(tokens), None, torch.device("cpu"))
        return receipt.on_device().sampled_token_ids.tolist()
