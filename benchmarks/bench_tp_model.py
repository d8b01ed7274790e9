"""Tensor-parallel decoding of static batches: output tokens/s and inter-token latency of
the sharded model, TP = 1 against TP = N, on dummy weights.

Not the serving engine (benchmarks/bench_tp_engine.py measures that): each rank loads its
shard of `dummy:<preset>`, prefills B prompts of --input-len random tokens (eagerly, in
chunks of at most --max-prefill-tokens), then decodes --output-len tokens per request
in full CUDA graphs of batch B (gpu/cuda_graphs.py; the all-reduces are captured in
them), sampling every step with batch-sharded sampling (T = 1, seeded) at TP > 1 and the
plain sampler at TP = 1. Default: the W3 shape (llama-3.1-8b, 128 in / 512 out) at batch
1 and 256. Reported per (TP, B): output tok/s over prefill + decode, decode-only tok/s,
and the decode step time (ITL) median / p90 / p99, from CUDA events on rank 0.

Correctness first (--check, on by default): dummy qwen3-0.6b in float32 at TP = N must
give rank 0's one-device model's prompt logits (to rtol 1e-3) and its 16 greedy tokens for
4 prompts; a mismatch fails the run before any timing.

    python benchmarks/bench_tp_model.py --tp 1,2 --out $OUT/tp_model_w3.json
    python benchmarks/bench_tp_model.py --preset qwen3-32b --tp 2 --batch 1,64 \
        --out $OUT/tp_model_32b.json          # a 32B model served over two GPUs
    python benchmarks/bench_tp_model.py --device cpu --preset qwen3-0.6b --tp 1,2 \
        --batch 2 --input-len 8 --output-len 4 --check-only   # smoke test over gloo
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._tp_bench import (  # noqa: E402
    StepTimer,
    attention_backend,
    header,
    join_group,
    run_ranks,
    synchronize,
    usable_tp_sizes,
)

from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from gpu.attention.base import AttentionMetadata, allocate_kv_cache  # noqa: E402
from gpu.cuda_graphs import DecodeGraphs, decode_metadata  # noqa: E402
from gpu.distributed.communicator import Communicator  # noqa: E402
from gpu.distributed.group import TPGroup  # noqa: E402
from gpu.distributed.tp_model import load_tp_model  # noqa: E402
from gpu.input_buffers import InputBuffers  # noqa: E402
from gpu.models.llama import DecoderModel  # noqa: E402
from gpu.sampling.batch_shard import BatchShardedSampler  # noqa: E402
from gpu.sampling.sampler import Sampler  # noqa: E402
from gpu.sampling.state import SamplingState  # noqa: E402
from gpu.weights.shard_loader import load_weight_shard  # noqa: E402

BLOCK_SIZE = 16
CHECK_PRESET, CHECK_PROMPTS, CHECK_INPUT_LEN, CHECK_OUTPUT_LEN = "qwen3-0.6b", 4, 32, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tp_model.json"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--tp", default="1,2", help="TP sizes (comma-separated)")
    parser.add_argument("--batch", default="1,256", help="batch sizes (comma-separated)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--check-only", action="store_true", help="only the correctness check")
    args = parser.parse_args()
    workload = {"preset": args.preset, "batch": [int(b) for b in args.batch.split(",")],
                "input_len": args.input_len, "output_len": args.output_len,
                "max_prefill_tokens": args.max_prefill_tokens, "dtype": args.dtype,
                "device": args.device, "check": not args.no_check,
                "check_only": args.check_only}
    tp_sizes, skipped = usable_tp_sizes([int(n) for n in args.tp.split(",")], args.device)
    runs = {}
    for tp_size in tp_sizes:
        runs[tp_size] = run_ranks(rank_main, tp_size, workload)[0]
    record = {**header("tp_model"), "workload": workload, "skipped_tp_sizes": skipped,
              "runs": {str(tp): run for tp, run in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    _print_table(runs, skipped)
    print(f"wrote {args.out}")


def rank_main(rank: int, tp_size: int, init_method: str, workload: dict[str, Any]
              ) -> dict[str, Any]:
    group = join_group(rank, tp_size, init_method, workload["device"])
    try:
        result: dict[str, Any] = {}
        if workload["check"] or workload["check_only"]:
            result["check"] = _check(group)
        if workload["check_only"]:
            return result
        dtype = getattr(torch, workload["dtype"])
        started = time.perf_counter()
        model = load_tp_model(f"dummy:{workload['preset']}", dtype, group,
                              attention_backend(group.device))
        synchronize(group.device)
        result["load_s"] = time.perf_counter() - started
        if group.device.type == "cuda":
            result["weights_gib_per_rank"] = torch.cuda.memory_allocated(group.device) / 2**30
        result["batches"] = {
            str(batch): StaticBatch(model, group, batch, workload).run(use_graphs=True)
            for batch in workload["batch"]}
        return result
    finally:
        group.close()


@dataclass(frozen=True, slots=True)
class DecodeResult:
    tokens: torch.Tensor  # [batch, output_len] int64
    prompt_logits: torch.Tensor | None  # [batch, vocab] float32, when asked for


class StaticBatch:
    """B requests of the same length through one rank's model: a chunked prefill, then
    decode steps that write the persistent input buffers and replay one graph."""

    def __init__(self, model: DecoderModel, group: TPGroup, batch: int,
                 workload: dict[str, Any], params: SamplingParams | None = None) -> None:
        self.model, self.device, self.batch = model, group.device, batch
        self.input_len, self.output_len = workload["input_len"], workload["output_len"]
        self.max_prefill_tokens = workload["max_prefill_tokens"]
        config = model.config
        self.max_model_len = self.input_len + self.output_len
        blocks_per_req = -(-self.max_model_len // BLOCK_SIZE)
        self.kv_caches = allocate_kv_cache(config.num_layers, batch * blocks_per_req, BLOCK_SIZE,
                                           model.num_kv_heads, config.head_dim, model.dtype,
                                           self.device)
        self.block_table = torch.arange(batch * blocks_per_req, dtype=torch.int32,
                                        device=self.device).view(batch, blocks_per_req)
        state = SamplingState(batch, config.vocab_size, self.device)
        params = params or SamplingParams(temperature=1.0)
        for row in range(batch):
            state.add_request(row, params.replace(seed=row), [1], [], [], row)
        self.sampler = (Sampler(state) if model.tp is None
                        else BatchShardedSampler(Sampler(state), model.tp))
        self.buffers = InputBuffers(batch, batch, blocks_per_req, self.device)
        self.buffers.block_table.copy_(self.block_table)
        self.buffers.query_start_loc.copy_(torch.arange(batch + 1, dtype=torch.int32))
        self._rows: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor]] = {}
        generator = np.random.default_rng(batch)
        self.prompts = torch.from_numpy(generator.integers(
            0, config.vocab_size, size=(batch, self.input_len))).to(self.device)

    @torch.inference_mode()
    def run(self, use_graphs: bool) -> dict[str, Any]:
        graphs = self._capture() if use_graphs and self.device.type == "cuda" else None
        synchronize(self.device)
        started = time.perf_counter()
        first = self._prefill(keep_logits=False)
        synchronize(self.device)
        prefill_s = time.perf_counter() - started
        timer = StepTimer(self.device)
        tokens = self._decode(first.tokens[:, 0], graphs, timer)
        synchronize(self.device)
        total_s = time.perf_counter() - started
        decode_s = total_s - prefill_s
        num_output = self.batch * self.output_len
        return {"prefill_s": prefill_s, "decode_s": decode_s,
                "output_tok_s": num_output / total_s,
                "decode_tok_s": self.batch * (self.output_len - 1) / decode_s,
                "itl": timer.summary(), "cuda_graphs": graphs is not None,
                "distinct_tokens": int(torch.unique(tokens).numel())}

    def greedy(self) -> DecodeResult:
        with torch.inference_mode():
            first = self._prefill(keep_logits=True)
            tokens = self._decode(first.tokens[:, 0], None, StepTimer(self.device))
        return DecodeResult(tokens, first.prompt_logits)

    def _capture(self) -> DecodeGraphs:
        graphs = DecodeGraphs(self.model.forward, self.kv_caches, self.buffers, (self.batch,),
                              self.max_model_len)
        graphs.capture()
        return graphs

    def _prefill(self, keep_logits: bool) -> DecodeResult:
        per_chunk = max(1, self.max_prefill_tokens // self.input_len)
        tokens, logits = [], []
        for first in range(0, self.batch, per_chunk):
            rows = torch.arange(first, min(first + per_chunk, self.batch), device=self.device)
            positions = torch.arange(self.input_len, device=self.device).repeat(rows.numel())
            metadata = self._prefill_metadata(rows, positions)
            hidden = self.model(self.prompts[rows].reshape(-1), positions, self.kv_caches, metadata)
            last = hidden[self.input_len - 1::self.input_len]
            if keep_logits:
                logits.append(self.model.compute_logits(last))
            tokens.append(self._sample(last, first, self.input_len))
        return DecodeResult(torch.cat(tokens)[:, None], torch.cat(logits) if keep_logits else None)

    def _prefill_metadata(self, rows: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        num_reqs = rows.numel()
        query_start_loc = np.arange(num_reqs + 1, dtype=np.int32) * self.input_len
        seq_lens = np.full(num_reqs, self.input_len, dtype=np.int32)
        table = self.block_table[rows]
        slots = table.gather(1, (positions.view(num_reqs, -1) // BLOCK_SIZE)) * BLOCK_SIZE
        slots = (slots + positions.view(num_reqs, -1) % BLOCK_SIZE).reshape(-1).long()
        return AttentionMetadata(
            num_actual_tokens=positions.numel(), num_reqs=num_reqs, max_query_len=self.input_len,
            max_seq_len=self.input_len,
            query_start_loc=torch.from_numpy(query_start_loc).to(self.device),
            seq_lens=torch.from_numpy(seq_lens).to(self.device), slot_mapping=slots,
            block_table=table, query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)

    def _decode(self, last_tokens: torch.Tensor, graphs: DecodeGraphs | None,
                timer: StepTimer) -> torch.Tensor:  # [batch, output_len]
        buffers, batch = self.buffers, self.batch
        outputs = [last_tokens]
        for step in range(1, self.output_len):
            timer.start()
            position = self.input_len + step - 1
            buffers.input_ids[:batch].copy_(outputs[-1])
            buffers.positions[:batch].fill_(position)
            buffers.seq_lens[:batch].fill_(position + 1)
            buffers.slot_mapping[:batch].copy_(
                self.block_table[:, position // BLOCK_SIZE].long() * BLOCK_SIZE
                + position % BLOCK_SIZE)
            if graphs is not None:
                hidden = graphs.run(batch)
            else:
                metadata = decode_metadata(buffers, batch, self.max_model_len,
                                           np.arange(batch + 1, dtype=np.int32),
                                           np.full(batch, position + 1, dtype=np.int32))
                hidden = self.model(buffers.input_ids[:batch], buffers.positions[:batch],
                                    self.kv_caches, metadata)
            outputs.append(self._sample(hidden, 0, position + 1))
            timer.stop()
        return torch.stack(outputs, dim=1)

    def _sample(self, hidden: torch.Tensor, first_row: int, position: int) -> torch.Tensor:
        """Sample rows [first_row, first_row + len(hidden)) with no host-device sync."""
        num_rows = hidden.shape[0]
        key = (first_row, num_rows)
        if key not in self._rows:  # a pageable host-to-device copy waits for the device
            rows_np = np.arange(first_row, first_row + num_rows, dtype=np.int32)
            self._rows[key] = (rows_np, torch.from_numpy(rows_np).to(self.device))
        rows_np, rows_gpu = self._rows[key]
        order = self.sampler.logits_row_order(num_rows) if self.model.tp is not None else None
        local = self.model.compute_logits_local(hidden if order is None else hidden[order])
        positions = torch.full((num_rows,), position, dtype=torch.int64, device=self.device)
        return self.sampler(local.float() if order is None else local, rows_gpu, rows_np,
                            positions, torch.zeros(num_rows, dtype=torch.int32, device=self.device),
                            None).sampled_token_ids


def _check(group: TPGroup) -> dict[str, Any]:
    """Sharded float32 qwen3-0.6b vs rank 0's one-device model: same prompt logits (to
    float32 rounding) and the same greedy tokens. Raises on a mismatch."""
    workload = {"input_len": CHECK_INPUT_LEN, "output_len": CHECK_OUTPUT_LEN,
                "max_prefill_tokens": 64}
    greedy = SamplingParams(temperature=0.0)
    model = load_tp_model(f"dummy:{CHECK_PRESET}", torch.float32, group,
                          attention_backend(group.device))
    sharded = StaticBatch(model, group, CHECK_PROMPTS, workload, greedy).greedy()
    del model
    if group.rank != 0:
        return {}
    shard = load_weight_shard(f"dummy:{CHECK_PRESET}", torch.float32, group.device, 0, 1)
    single_model = DecoderModel(shard.config, attention_backend(group.device), torch.float32,
                                group.device)
    single_model.load_weights(shard.weights)
    single = StaticBatch(single_model, group, CHECK_PROMPTS, workload, greedy).greedy()
    max_error = float((sharded.prompt_logits - single.prompt_logits).abs().max())
    torch.testing.assert_close(sharded.prompt_logits, single.prompt_logits, rtol=1e-3, atol=1e-3)
    if not torch.equal(sharded.tokens, single.tokens):
        raise AssertionError(f"TP={group.world_size} greedy tokens differ from one device:\n"
                             f"{sharded.tokens.tolist()}\n{single.tokens.tolist()}")
    return {"preset": CHECK_PRESET, "passed": True, "max_abs_logit_error": max_error,
            "num_tokens": int(single.tokens.numel())}


def _print_table(runs: dict[int, dict[str, Any]], skipped: dict[int, str]) -> None:
    print(f"{'tp':>3} {'batch':>5} {'out tok/s':>10} {'decode tok/s':>12} {'ITL med ms':>10} "
          f"{'ITL p99 ms':>10}")
    for tp_size, run in runs.items():
        print(f"tp {tp_size} check: {run.get('check', 'skipped')}")
        for batch, result in run.get("batches", {}).items():
            itl = result["itl"]
            print(f"{tp_size:>3} {batch:>5} {result['output_tok_s']:>10.0f} "
                  f"{result['decode_tok_s']:>12.0f} {itl['median_ms']:>10.3f} "
                  f"{itl['p99_ms']:>10.3f}")
    for tp_size, why in skipped.items():
        print(f"tp {tp_size} skipped: {why}")


if __name__ == "__main__":
    main()
