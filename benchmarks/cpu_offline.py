"""The CPU offline benchmark of the embedded model (SmolLM2-135M-Instruct, float32):
load times, single-request and batch-8 decode speed, and 32-prompt batched throughput,
for tandem's V2 and V1 runners and transformers on the same chat prompts.

    python -m benchmarks.cpu_offline --output benchmarks/results/cpu_offline.json

Every arm decodes greedily to a fixed length (tandem: ignore_eos; transformers:
min_new_tokens = max_new_tokens, left-padded batches). Arms run interleaved (v2 v1 hf,
then hf v1 v2, ...). Single-request decode speed excludes the prefill: it is
(n - 1) / (time for n tokens - time for 1 token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.run_info import command_line, load_average, run_header

ARMS = ("v2", "v1", "hf")
_TOPICS = (
    "the ocean", "bicycles", "volcanoes", "bread baking", "the moon", "chess", "honeybees",
    "glaciers", "jazz", "lighthouses", "origami", "rainforests", "trains", "coffee", "deserts",
    "kites", "penguins", "libraries", "thunderstorms", "windmills", "coral reefs", "tea",
    "mountains", "owls", "bridges", "the alphabet", "gardens", "comets", "sailing", "clocks",
    "maple trees", "music boxes",
)

Generate = Callable[[list[list[int]], int], list[list[int]]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode-tokens", type=int, default=32, help="new tokens, single/batch 8")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--throughput-prompts", type=int, default=32)
    p.add_argument("--throughput-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the benchmark machines are shared)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/cpu_offline.json"))
    return p.parse_args(argv)


def chat_prompts(llm: Any, count: int) -> list[list[int]]:
    """Token ids of `count` chat-templated questions (distinct topics, similar lengths)."""
    texts = [f"Write a short paragraph about {_TOPICS[i % len(_TOPICS)]}." for i in range(count)]
    return [llm.tokenizer.encode(llm.apply_chat_template(text)) for text in texts]


def tandem_generator(llm: Any) -> Generate:
    from actors.protocol.sampling_params import SamplingParams

    def generate(prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=num_tokens, ignore_eos=True, temperature=0.0)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    return generate


def hf_generator(hf: Any) -> Generate:
    @torch.inference_mode()
    def generate(prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)  # pad id 0, masked out
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=num_tokens,
                          min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    return generate


def timed(generate: Generate, prompts: list[list[int]], num_tokens: int
          ) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = generate(prompts, num_tokens)
    return time.perf_counter() - started, outputs


def measure_arm(generate: Generate, prompts: list[list[int]], args: argparse.Namespace
                ) -> tuple[dict[str, Any], list[list[int]]]:
    """One repeat of every scenario on one arm; returns figures and the batch outputs."""
    n = args.decode_tokens
    first_s, _ = timed(generate, prompts[:1], 1)
    single_s, single_out = timed(generate, prompts[:1], n)
    batch_s, batch_out = timed(generate, prompts[:args.batch_size], n)
    tput_prompts = prompts[:args.throughput_prompts]
    tput_s, tput_out = timed(generate, tput_prompts, args.throughput_tokens)
    num_tput_tokens = sum(len(o) for o in tput_out)
    if len(single_out[0]) != n or any(len(o) != n for o in batch_out) \
            or num_tput_tokens != len(tput_prompts) * args.throughput_tokens:
        raise RuntimeError("an arm generated fewer tokens than asked for")
    return {
        "single_first_token_s": first_s, "single_s": single_s,
        "single_decode_tok_s": (n - 1) / (single_s - first_s),
        "single_output_tok_s": n / single_s,
        "batch_s": batch_s, "batch_output_tok_s": args.batch_size * n / batch_s,
        "throughput_s": tput_s, "throughput_output_tok_s": num_tput_tokens / tput_s,
        "load_average": load_average(),
    }, batch_out


def load_arms(record: dict[str, Any], max_num_seqs: int) -> dict[str, Generate]:
    started = time.perf_counter()
    from app.llm import LLM

    record["load"] = {"import_app_llm_s": time.perf_counter() - started}
    started = time.perf_counter()
    v2 = LLM("default", device="cpu", dtype="float32", runner="v2", max_num_seqs=max_num_seqs)
    record["load"].update(llm_wall_s=time.perf_counter() - started,
                          worker_load_time_s=v2.worker.load_time_s, runner=v2.runner)
    v1 = LLM("default", reuse=v2, device="cpu", dtype="float32", runner="v1",
             max_num_seqs=max_num_seqs)
    from tests._hf_reference import hf_reference_model

    started = time.perf_counter()
    hf = hf_reference_model()
    record["load"]["hf_from_converted_cache_s"] = time.perf_counter() - started
    record["prompts"] = chat_prompts(v2, max(record["workload"]["throughput_prompts"],
                                             record["workload"]["batch_size"]))
    return {"v2": tandem_generator(v2), "v1": tandem_generator(v1), "hf": hf_generator(hf)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("single_decode_tok_s", "single_output_tok_s", "batch_output_tok_s",
            "throughput_output_tok_s")
    summary = {}
    for arm in ARMS:
        arm_runs = [r for r in runs if r["arm"] == arm]
        summary[arm] = {key: {"median": statistics.median(r[key] for r in arm_runs),
                              "min": min(r[key] for r in arm_runs),
                              "max": max(r[key] for r in arm_runs)} for key in keys}
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    record: dict[str, Any] = {
        "benchmark": "cpu_offline", **run_header(command_line()),
        "workload": {"model": "default (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized)",
                     "device": "cpu", "dtype": "float32", "decoding": "greedy, fixed length",
                     "decode_tokens": args.decode_tokens, "batch_size": args.batch_size,
                     "throughput_prompts": args.throughput_prompts,
                     "throughput_tokens": args.throughput_tokens, "repeats": args.repeats,
                     "torch_threads": torch.get_num_threads()},
        "runs": []}
    generators = load_arms(record, max_num_seqs=max(args.throughput_prompts, args.batch_size))
    prompts = record.pop("prompts")
    record["workload"]["prompt_lens"] = sorted({len(p) for p in prompts})
    for generate in generators.values():  # warmup: every batch shape the runs use, once
        for count in (1, args.batch_size, args.throughput_prompts):
            generate(prompts[:count], 2)
    batch_outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for arm in ARMS if repeat % 2 == 0 else tuple(reversed(ARMS)):
            figures, batch_outputs[arm] = measure_arm(generators[arm], prompts, args)
            record["runs"].append({"arm": arm, "repeat": repeat, **figures})
            print(f"{arm} repeat {repeat}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in figures.items() if k.endswith("tok_s")), flush=True)
            _write(args.output, record)
    record["summary"] = summarise(record["runs"])
    record["batch_greedy_agreement_with_v2"] = {
        arm: sum(a == b for a, b in zip(batch_outputs[arm], batch_outputs["v2"]))
        / len(batch_outputs["v2"]) for arm in ("v1", "hf")}
    record["load_average_after"] = load_average()
    _write(args.output, record)
    print(f"wrote {args.output}")
    return 0


def _write(output: Path, record: dict[str, Any]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
