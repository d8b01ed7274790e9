"""Structured outputs against a running server: a correctness check, and the throughput
ratio of constrained to free output from `tandem bench serve` results.

    python benchmarks/grammar_serve.py check --base-url URL --out check.json
        concurrent chat requests (streamed and not) under a json_schema, a regex and a
        choice (bounded, so that even random weights complete them); every output must finish with 'stop' and obey its constraint
        (jsonschema validation). Exit 1 otherwise.
    python benchmarks/grammar_serve.py ratio --free A.json B.json --constrained C.json D.json \\
        --out ratio.json
        mean output tok/s of the constrained runs over the free ones (target >= 0.8).

The throughput schema (THROUGHPUT_SCHEMA, written by `schema`) is an array of at least 200
small objects, so that the constrained output is as long as the free one (512 tokens,
ignore_eos) while the grammar works on keys, numbers, enums and strings all along. Its
strings are unbounded, as OpenAI's strict mode writes them; `schema --max-length N` bounds
them, the grammar library's slow case: a batch of 256 bounded rows meeting new states fills
in 29 ms at p50 against 4.7 ms unbounded (Qwen3 vocabulary, one CPU thread;
benchmarks/results/grammar/fill_cold_warm_cpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serve_client import sse_lines  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
THROUGHPUT_SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}


def throughput_schema(max_length: int | None = None) -> dict[str, Any]:
    """THROUGHPUT_SCHEMA, its strings bounded to `max_length` characters when given."""
    schema = copy.deepcopy(THROUGHPUT_SCHEMA)
    if max_length is not None:
        schema["items"]["properties"]["name"]["maxLength"] = max_length
    return schema


REGEX = r"[a-z]{3,8}-[0-9]{2,4}"
CHOICES = ["alpha", "beta", "gamma"]


def _constraints() -> list[tuple[str, dict[str, Any], Any]]:
    """(name, request fields, check of the output text)."""
    import jsonschema

    return [
        ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}}},
         lambda text: jsonschema.validate(json.loads(text), PERSON)),
        ("regex", {"structured_outputs": {"regex": REGEX}},
         lambda text: _require(re.fullmatch(REGEX, text) is not None, "regex mismatch")),
        ("choice", {"structured_outputs": {"choice": CHOICES}},
         lambda text: _require(text in CHOICES, "not a choice")),
    ]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


async def _one(http: httpx.AsyncClient, model: str, fields: dict[str, Any], index: int,
               stream: bool) -> tuple[str, str | None]:
    body = {"model": model, "max_tokens": 256, "temperature": 1.0, "seed": index,
            "messages": [{"role": "user", "content": f"Describe person number {index}."}],
            "stream": stream, **fields}
    if not stream:
        response = await http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, finish = [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in sse_lines(response):
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
    return "".join(text), finish


async def check(base_url: str, num_requests: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for name, fields, validate in _constraints():
            outputs = await asyncio.gather(*(_one(http, model, fields, i, stream=i % 2 == 1)
                                             for i in range(num_requests)))
            failures = []
            for text, finish in outputs:
                try:
                    _require(finish == "stop", f"finish_reason {finish}")
                    validate(text)
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    failures.append({"text": text[:300], "error": str(exc)[:300]})
            results[name] = {"num_requests": num_requests, "num_invalid": len(failures),
                             "failures": failures[:5], "example": outputs[0][0][:300]}
    return results


def _mean_output_tok_s(paths: list[Path]) -> tuple[float, list[float]]:
    values = [json.loads(p.read_text())["levels"][-1]["output_throughput_tok_s"] for p in paths]
    return statistics.fmean(values), values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check")
    p_check.add_argument("--base-url", default="http://127.0.0.1:8000")
    p_check.add_argument("--num-requests", type=int, default=64)
    p_check.add_argument("--out", type=Path, required=True)
    p_schema = sub.add_parser("schema", help="write the throughput response_format")
    p_schema.add_argument("--out", type=Path, required=True)
    p_schema.add_argument("--max-length", type=int, default=None,
                          help="bound the strings (maxLength)")
    p_ratio = sub.add_parser("ratio")
    p_ratio.add_argument("--free", type=Path, nargs="+", required=True)
    p_ratio.add_argument("--constrained", type=Path, nargs="+", required=True)
    p_ratio.add_argument("--bounded", type=Path, nargs="*", default=[],
                         help="runs under the bounded-string schema (reported, no target)")
    p_ratio.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "schema":
        args.out.write_text(json.dumps({"type": "json_schema", "json_schema": {
            "name": "people", "schema": throughput_schema(args.max_length), "strict": True}}))
        return 0
    if args.command == "check":
        results = asyncio.run(check(args.base_url, args.num_requests))
        args.out.write_text(json.dumps(results, indent=2))
        for name, result in results.items():
            print(f"check {name:12s} {result['num_requests'] - result['num_invalid']}/"
                  f"{result['num_requests']} valid  e.g. {result['example'][:60]!r}")
        return 0 if all(r["num_invalid"] == 0 for r in results.values()) else 1
    free, free_runs = _mean_output_tok_s(args.free)
    constrained, constrained_runs = _mean_output_tok_s(args.constrained)
    ratio = constrained / free
    result = {"free_output_tok_s": free, "constrained_output_tok_s": constrained,
              "free_runs": free_runs, "constrained_runs": constrained_runs,
              "ratio": ratio, "target": 0.8, "meets_target": ratio >= 0.8}
    print(f"{'arm':14s} {'output tok/s (mean of runs)':>28s}\n{'free':14s} {free:28.1f}\n"
          f"{'json_schema':14s} {constrained:28.1f}\nratio {ratio:.3f} (target >= 0.80)")
    if args.bounded:
        bounded, bounded_runs = _mean_output_tok_s(args.bounded)
        result.update(bounded_output_tok_s=bounded, bounded_runs=bounded_runs,
                      bounded_ratio=bounded / free)
        print(f"{'bounded':14s} {bounded:28.1f}\nbounded ratio {bounded / free:.3f}")
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
