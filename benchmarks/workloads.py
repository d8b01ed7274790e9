"""The suite's workloads: what is asked of the engine, and the floor the hardware puts under
each.

Offline (`benchmarks.throughput`): fixed-length random token-id prompts, vLLM-style; every
request has the same prompt and output length (`ignore_eos`, min = max tokens), so every
arm does exactly the same work and output tokens/s compares directly. Served
(`benchmarks.serve`): token-id prompts for /v1/completions, or text for chat made of
common words, cut to exactly `input_len` tokens with the server's tokenizer.

Floor (decode is bound by memory bandwidth): every step reads all weights once, and every
decoding request reads its whole KV history. For N requests of input I and output O the
KV tokens read are N * (O*I + O*(O-1)/2), so

    ideal_s = (num_steps * weight_bytes + kv_tokens_read * kv_bytes_per_token) / bandwidth
              + prefill_flops / matmul_rate

A large model at a large batch is bound by matmul throughput instead (llama-3.1-8b at
batch 1024 does 16 TFLOP per decode step, 21 ms at 790 TFLOP/s, against 15 ms of memory
traffic): the compute floor 2 * params * N * (I + O) / matmul_rate is given too.

Mixture-of-experts models (W4, W5): a step reads the shared weights and each expert that
at least one of its tokens is routed to. With B tokens spread uniformly over E experts, k
per token, that is E * (1 - (1 - k/E) ** B) experts per layer: the k active ones at batch
1, all of them from a few dozen tokens on. The compute counts active parameters only.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from typing import Any

COPY_BANDWIDTH_BYTES_PER_S = 4.26e12
"""Device-to-device copy bandwidth measured on the H200 (bytes read + written per second)."""
BF16_MATMUL_FLOPS_PER_S = 790e12
"""bf16 dense matmul rate measured on the H200."""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    model: str
    num_prompts: int
    input_len: int
    output_len: int
    device: str = "cuda"
    dtype: str = "bfloat16"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "dummy:qwen3-0.6b", 1024, 128, 512),
    "W2": Workload("W2", "dummy:qwen3-0.6b", 1000, 1024, 128),
    "W3": Workload("W3", "dummy:llama-3.1-8b", 1024, 128, 512),
    "W4": Workload("W4", "dummy:gpt-oss-20b", 1024, 128, 512),
    "W5": Workload("W5", "dummy:qwen3-30b-a3b", 1024, 128, 512),
    "CPU": Workload("CPU", "default", 32, 128, 64, device="cpu", dtype="float32"),
}
"""W1-W5 on the GPU (dummy weights; W4 with MXFP4 experts, as gpt-oss ships); CPU: the
embedded SmolLM2-135M-Instruct."""


def workload_by_name(name: str) -> Workload:
    try:
        return WORKLOADS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Distinct uniformly random token-id prompts (no shared prefixes to cache)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num_prompts, input_len)).tolist()


def floors(
    model: Any, workload: Workload, num_steps: int | None = None, dtype_bytes: int = 2
) -> dict[str, Any]:
    """The bandwidth and compute floors of `workload` on `model` (a gpu.models ModelConfig)
    at the H200's rates; `num_steps` defaults to one step per output token, each over the
    workload's whole batch."""
    n, i, o = workload.num_prompts, workload.input_len, workload.output_len
    num_steps = o if num_steps is None else num_steps
    # The head matrix is read whole each step; the embedding lookup reads a few rows only.
    embedding_lookup = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    weight_bytes = step_weight_bytes(model, n, dtype_bytes) - embedding_lookup * dtype_bytes
    kv_bytes = n * (o * i + o * (o - 1) // 2) * model.kv_bytes_per_token * dtype_bytes
    active_params = (
        model.num_active_params() if hasattr(model, "num_active_params") else model.num_params()
    )
    prefill_flops = 2 * active_params * n * i
    ideal_s = (
        num_steps * weight_bytes + kv_bytes
    ) / COPY_BANDWIDTH_BYTES_PER_S + prefill_flops / BF16_MATMUL_FLOPS_PER_S
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_read": kv_bytes,
        "num_steps": num_steps,
        "prefill_flops": prefill_flops,
        "ideal_s": ideal_s,
        "roofline_output_tok_s": n * o / ideal_s,
        "compute_floor_s": 2 * active_params * n * (i + o) / BF16_MATMUL_FLOPS_PER_S,
        "bandwidth_bytes_per_s": COPY_BANDWIDTH_BYTES_PER_S,
        "matmul_flops_per_s": BF16_MATMUL_FLOPS_PER_S,
    }


def step_weight_bytes(model: Any, num_tokens: int, dtype_bytes: int = 2) -> float:
    """Weight bytes a step of `num_tokens` tokens reads (every weight of a dense model; for
    a mixture of experts, the shared weights and the experts expected to receive a token)."""
    if not hasattr(model, "weight_bytes"):  # a baseline engine older than the MoE models
        return float(model.num_params() * dtype_bytes)
    total = model.weight_bytes(dtype_bytes)
    if not model.is_moe:
        return total
    active = model.weight_bytes(dtype_bytes, active_only=True)
    num_experts, top_k = model.num_experts, model.num_experts_per_tok
    bytes_per_expert = (total - active) / (num_experts - top_k)  # over all MoE layers
    experts_hit = num_experts * (1 - (1 - top_k / num_experts) ** max(num_tokens, 1))
    return active + (experts_hit - top_k) * bytes_per_expert


# ---- served requests --------------------------------------------------------------------

DEFAULT_TOKEN_ID_RANGE = (1000, 32000)
"""Ordinary vocabulary of every supported tokenizer: above Llama 2's byte tokens and
SmolLM2's specials, below Llama 2's vocabulary size and Llama 3's / Qwen's specials."""
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend "
    "father power hour game line end member law car city community name president team "
    "minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air "
    "teacher force education river light green small large early young important public bad "
    "able blue"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class ServeWorkload:
    endpoint: str
    num_prompts: int
    input_len: int
    output_len: int
    ignore_eos: bool
    temperature: float
    seed: int
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE
    tokenizer: str | None = None
    """A tokenizer.json or Hugging Face directory that sizes chat prompts in tokens."""
    response_format: dict[str, Any] | None = None
    """Sent as every request's response_format (structured outputs)."""
    extra_body: dict[str, Any] | None = None
    """Fields merged into every request body last (e.g. what another server needs instead
    of ignore_eos: max_tokens, a logit_bias that bans the end-of-sequence token)."""
    time_by_text: bool = False
    """TTFT at the first chunk with text, tokens counted by chunk where no usage comes
    (benchmarks.serve_metrics.StreamTimeline.by_text)."""


def token_id_prompts(
    num_prompts: int,
    input_len: int,
    seed: int,
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
) -> list[list[int]]:
    """`num_prompts` lists of `input_len` token ids drawn uniformly from [low, high)."""
    low, high = token_id_range
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num_prompts)]


def text_prompts(num_prompts: int, input_len: int, seed: int, tokenizer: Any = None) -> list[str]:
    """Sentences of `input_len` random common words (roughly one token each); with a
    tokenizer, cut to exactly `input_len` tokens (each word is one or more whole tokens,
    so the cut text encodes back to the same length)."""
    rng = random.Random(seed)
    num_words = input_len if tokenizer is None else 2 * input_len
    texts = [" ".join(rng.choice(_WORDS) for _ in range(num_words)) for _ in range(num_prompts)]
    if tokenizer is None:
        return texts
    return [tokenizer.decode(tokenizer.encode(text)[:input_len]) for text in texts]


def serve_prompts(workload: ServeWorkload, seed: int, num_prompts: int | None = None) -> list[Any]:
    count = workload.num_prompts if num_prompts is None else num_prompts
    if workload.endpoint == "completions":
        return token_id_prompts(count, workload.input_len, seed, workload.token_id_range)
    tokenizer = None
    if workload.tokenizer is not None:
        from app.tokenizer_loader import load_tokenizer

        tokenizer = load_tokenizer(workload.tokenizer)
    return text_prompts(count, workload.input_len, seed, tokenizer)


def request_body(workload: ServeWorkload, prompt: Any, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": workload.temperature,
    }
    if workload.endpoint == "completions":
        body.update(prompt=prompt, max_tokens=workload.output_len)
    else:
        body.update(
            messages=[{"role": "user", "content": prompt}],
            max_completion_tokens=workload.output_len,
        )
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if workload.response_format is not None:
        body["response_format"] = workload.response_format
    if workload.extra_body is not None:
        body.update(workload.extra_body)
    return body


def prompts_digest(prompts: list[Any]) -> str:
    """A short fingerprint, so two results can show they ran the same prompts."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
