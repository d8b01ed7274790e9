"""Every message tandem's actors exchange, typed (msgspec structs), in one module.

Four groups:

- the protocol between the front end (API-server processes: HTTP, tokenizer, output
  processing) and the engine core (scheduler, KV cache manager, GPU actor). These cross a
  process boundary (actors/protocol/transport.py), so they are plain data: numbers, strings, tuples
  and numpy arrays, never objects with behaviour;
- the messages inside the engine core (scheduler -> GPU actor -> scheduler);
- the messages inside a front end (to its output processor);
- a front end's messages to its grammar checker processes, which compile new structured
  output specs where a crash or a hang harms no one else.

Messages are per request or per step, never per token per request: a step's results
travel as one message with arrays for the whole batch.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutputSpec

# ==== front end -> engine core =========================================================


class PromptEmbeds(msgspec.Struct, frozen=True):
    """A prompt given as one embedding row per position instead of token ids (decoded and
    checked by actors/protocol/prompt_embeds.py). The request's prompt_token_ids are then
    placeholders (0, one per row): the prefill runs these rows where it would look token
    ids up in the embedding table; tokens generated after them are ordinary."""

    data: bytes
    """[num_tokens, hidden_size] little-endian, row-major."""
    dtype: str
    """'float32', 'bfloat16' or 'float16' (the engine converts to the model's dtype)."""
    num_tokens: int
    hidden_size: int
    digest: bytes
    """blake2b of dtype, shape and data: the prefix cache keys these rows' blocks by it."""


class EngineRequest(msgspec.Struct, frozen=True, tag="request"):
    """One sequence to generate (a request with n samples is n of these)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    arrival_time: float
    """time.monotonic() when the request reached the server (CLOCK_MONOTONIC is shared by
    every process of the host)."""
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    """Lower runs earlier (FCFS among equals)."""
    cache_salt: str | None = None
    client_index: int = 0
    """The front end that owns the request: its outputs go there."""
    trace_context: dict[str, str] | None = None
    """W3C trace context (traceparent, tracestate) of the request's span."""
    prompt_embeds: PromptEmbeds | None = None
    """The prompt as embedding rows (--enable-prompt-embeds); prompt_token_ids are then
    placeholders."""


class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    """Free these requests' rows and KV blocks now (client gone, stop string found)."""

    request_ids: tuple[str, ...]


class ClientHello(msgspec.Struct, frozen=True, tag="hello"):
    """A front end (re)connected. Requests an earlier process with the same index left
    behind are aborted; the core answers with EngineReady once it is warm.

    Over ZMQ the hello is what authenticates a peer: the core's endpoint ignores every
    other message of a peer until it has said hello with the launch's secret."""

    client_index: int | None
    """None: a peer that is no front end and only sends Shutdown (the supervisor); the
    transport authenticates it and passes its hello on to no one."""
    secret: bytes = b""
    """The per-launch secret (actors/protocol/launch_secret.py); the ZMQ client endpoint
    fills it in."""


class UtilityCall(msgspec.Struct, frozen=True, tag="utility"):
    """Ask the engine core something outside the step loop; answered by UtilityResult."""

    call_id: int
    method: str
    """'stats' (SchedulerStats), 'check_kv_invariants' (error set when broken) or
    'reset_prefix_cache' (PrefixCacheReset)."""
    client_index: int = 0
    """Where the answer goes."""


class GrammarVocab(msgspec.Struct, frozen=True, tag="grammar_vocab"):
    """The front end's tokenizer, sent once before its first request with a structured
    output: the core compiles grammars against it (the core loads no tokenizer itself)."""

    tokenizer_json: str
    """A `tokenizers` tokenizer.json."""
    eos_token_ids: tuple[int, ...]


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    """Abort what is left, drain the steps in flight and exit."""


# ==== engine core -> front end =========================================================


class EngineReady(msgspec.Struct, frozen=True, tag="ready"):
    """The engine core is loaded and warm: every kernel and graph the first requests need
    has been compiled and captured."""

    model_source: str
    architecture: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int
    max_num_seqs: int
    runner: str
    runner_reason: str
    runner_rule: str
    device: str
    startup_s: float
    pid: int
    weights: str = ""
    """What runs in what precision (gpu/models/precision.py), e.g. "weights: fp8 (block
    128x128, dynamic per-token-group activations) for 196 projections; bfloat16 for
    lm_head, embeddings, norms"."""
    kv_cache_dtype: str = ""
    """The KV cache's element type (--kv-cache-dtype resolved): "fp8_e4m3", "bfloat16", ..."""
    hidden_size: int = 0
    """Width of the model's embeddings (the columns a request's prompt_embeds must have)."""
    kv_offload: str = ""
    """The prefix cache's offload tiers, one line ("" when off)."""


class EngineStartupFailed(msgspec.Struct, frozen=True, tag="startup_failed"):
    message: str
    is_user_error: bool
    """The configuration is at fault (exit code 2), not a bug (exit code 1)."""


HEARTBEAT_INTERVAL_S = 0.5
"""How often a core process sends Heartbeat; a front end's stall bound must be longer."""


class CoreLoad(msgspec.Struct, frozen=True, array_like=True):
    """How busy one engine core is, told to one front end: what a front end balancing
    requests over the cores of `--data-parallel-size N` reads (actors/frontend/dp_balancer.py)."""

    num_running: int
    num_waiting: int
    num_received: int = 0
    """Requests of this front end the core has taken in (since the front end's process said
    hello): those it sent beyond these are still on their way, in neither count above."""


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """The engine core's event loop still turns: sent to every front end every
    HEARTBEAT_INTERVAL_S by a task on that loop (steps run on the GPU actor's threads, so
    a long step does not delay it). A core that is stopped (SIGSTOP) or whose loop is
    blocked falls silent, and the front end reports it stalled."""

    load: CoreLoad | None = None
    """The core's load now (None while it loads the model): a front end with no request
    in the core hears no steps, and learns of the other front ends' requests here."""


class EngineDead(msgspec.Struct, frozen=True, tag="dead"):
    """The core cannot serve any more (consecutive failed steps): /health turns 503."""

    reason: str


class PredecessorAborted(msgspec.Struct, frozen=True, tag="predecessor_aborted"):
    """Sent to a front end that said hello under an index seen before: the requests its
    previous process (killed, crashed) left running, which the core has just aborted.
    The new process counts them, since nobody else saw them end."""

    num_requests: int


class SchedulerStats(msgspec.Struct, frozen=True):
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    num_total_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage_perc: float
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_free_rows: int | None
    """Free runner rows (None when the runner does not keep rows)."""
    kv_tiers: tuple[KVTierStats, ...] = ()
    """The prefix cache's offload tiers (host memory, disk), when on."""


class KVTierStats(msgspec.Struct, frozen=True):
    """One offload tier of the prefix cache; the counts are cumulative."""

    tier: str
    """'cpu' (host memory) or 'disk'."""
    queries_tokens: int
    """Tokens of admitted requests looked up in this tier (missed by the tiers before it)."""
    hits_tokens: int
    """Of those, tokens found here (their KV copied back instead of computed)."""
    saved_bytes: int
    """Bytes written into this tier."""
    loaded_bytes: int
    """Bytes read back out of it."""
    num_blocks: int
    """Blocks it holds now."""
    num_capacity_blocks: int


class PrefixCacheReset(msgspec.Struct, frozen=True):
    """What resetting the prefix cache did: blocks no request held are dropped, blocks in
    use stay cached (as vLLM, which drops only what is free)."""

    num_dropped_blocks: int
    num_kept_blocks: int
    """Cached blocks still held by requests."""
    num_dropped_offloaded_blocks: int = 0
    """Blocks dropped from the host-memory and disk tiers (all of them)."""


class UtilityResult(msgspec.Struct, frozen=True, tag="utility_result"):
    call_id: int
    stats: SchedulerStats | None = None
    error: str | None = None
    prefix_cache_reset: PrefixCacheReset | None = None


class LogprobsArrays(msgspec.Struct, frozen=True):
    token_ids: np.ndarray  # [num_sampled, 1 + k] int64: sampled token first, then top-k
    logprobs: np.ndarray  # [num_sampled, 1 + k] float32
    sampled_rank: np.ndarray  # [num_sampled] int64, 1-based rank of the sampled token

    def take(self, rows: np.ndarray) -> LogprobsArrays:  # rows: [n] int64
        return LogprobsArrays(self.token_ids[rows], self.logprobs[rows], self.sampled_rank[rows])


class PromptLogprobs(msgspec.Struct, frozen=True):
    """Logprobs of prompt tokens computed in one step, request-major: request i's rows are
    the prompt positions start_positions[i] .. start_positions[i] + num_rows[i] - 1 (a
    position's row: the logprob of the prompt token there given the tokens before it)."""

    request_ids: tuple[str, ...]
    start_positions: np.ndarray  # [len(request_ids)] int32, >= 1
    num_rows: np.ndarray  # [len(request_ids)] int32
    logprobs: LogprobsArrays
    """The prompt token first in each row (its rank in sampled_rank), then the top k."""

    def take(self, indices: list[int]) -> PromptLogprobs:
        """The rows of the requests at `indices`."""
        offsets = np.concatenate([[0], np.cumsum(self.num_rows)])
        rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in indices])
        return PromptLogprobs(
            tuple(self.request_ids[i] for i in indices),
            self.start_positions[indices],
            self.num_rows[indices],
            self.logprobs.take(rows.astype(np.int64)),
        )


class SpecDecodeStats(msgspec.Struct, frozen=True, array_like=True):
    """One step's speculative decoding counts, as vLLM's spec_decode metrics count them."""

    num_drafts: int
    """Requests that verified at least one draft token."""
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]
    """Per draft position j: requests whose draft j was accepted."""


class StepStats(msgspec.Struct, frozen=True):
    step_id: int
    num_reqs: int
    num_tokens: int
    num_prefill_tokens: int
    schedule_time_s: float = 0.0
    """CPU time the scheduler spent building this step."""
    prepare_time_s: float = 0.0
    """CPU time from receiving the step to the last launch."""
    step_time_s: float = 0.0
    """Device time of the step, measured with events where the device allows."""
    gpu_idle_s: float = 0.0
    """Device idle time between the previous step's end and this step's start."""
    spec: SpecDecodeStats | None = None
    """Speculative decoding counts of the step (None without speculation)."""


class RequestFinish(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    reason: str
    """'stop' (EOS or a stop token id), 'length', 'abort' or 'error'."""
    stop_token_id: int | None = None
    """The stop_token_ids entry that ended the request (None for EOS and the rest)."""
    error: str | None = None


class AdmittedRequest(msgspec.Struct, frozen=True, array_like=True):
    """What only the core knows of a request's timeline, sent once, at its first admission
    (never again after a preemption)."""

    request_id: str
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    queued_time: float
    """time.monotonic() when the core queued the request."""
    first_scheduled_time: float
    """time.monotonic() when the request was first scheduled (prefill start)."""


class EngineCoreOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    """One engine step's results for the requests of one front end (step_id -1: outcomes
    outside a step, such as a request refused when it arrived).

    A request that finishes in this step has its last tokens in `new_token_ids` and an
    entry in `finished`; `finished` also names requests that end without a token."""

    step_id: int
    request_ids: tuple[str, ...] = ()
    new_token_ids: np.ndarray | None = None  # [num_new_tokens] int32, request-major
    num_new_tokens: np.ndarray | None = None  # [len(request_ids)] int32; None: one each
    num_draft_tokens: np.ndarray | None = None  # [len(request_ids)] int32
    """Speculative steps: drafts each request verified (its accepted ones are
    num_new_tokens - 1 unless a stop cut the run); None without speculation."""
    logprobs: LogprobsArrays | None = None
    """Rows aligned with new_token_ids; None when no request asked for logprobs."""
    prompt_logprobs: PromptLogprobs | None = None
    """Prompt tokens' logprobs this step computed (they precede the request's new tokens)."""
    finished: tuple[RequestFinish, ...] = ()
    admitted: tuple[AdmittedRequest, ...] = ()
    step_stats: StepStats | None = None
    """The step's device and CPU timings (sent to front end 0 only, so that a server with
    several front ends counts each step once)."""
    scheduler_stats: SchedulerStats | None = None
    """The core's load and KV usage after the step was scheduled (front end 0 only)."""
    load: CoreLoad | None = None
    """The core's load after the step (every front end the step's outputs go to)."""


ToEngineCore = EngineRequest | AbortRequests | ClientHello | UtilityCall | GrammarVocab | Shutdown
ToFrontEnd = (
    EngineCoreOutputs
    | EngineReady
    | EngineStartupFailed
    | EngineDead
    | PredecessorAborted
    | UtilityResult
    | Heartbeat
)


# ==== inside the engine core: scheduler -> GPU actor ===================================


class NewRequestData(msgspec.Struct, frozen=True):
    """A request that takes a runner row: new, or resumed after preemption."""

    request_id: str
    token_ids: tuple[int, ...]
    """Prompt plus every output token generated before a preemption."""
    prompt_len: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    """Tokens already in the KV cache (prefix-cache hits)."""
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    """Suppressed until min_tokens outputs exist (unless ignore_eos)."""
    prompt_embeds: PromptEmbeds | None = None
    """Rows the prefill runs in place of the prompt's (placeholder) token ids."""


class CachedRequestData(msgspec.Struct, frozen=True):
    """Diffs for requests that already hold a row."""

    request_ids: tuple[str, ...] = ()
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    """Blocks appended to each request's block table this step."""


class GrammarBitmask(msgspec.Struct, frozen=True):
    """The allowed next tokens of the step's rows that sample under a grammar."""

    batch_indices: np.ndarray  # [num_masked] int32, positions in scheduled_request_ids
    bitmask: np.ndarray  # [num_masked, ceil(vocab_size / 32)] int32, bit set = allowed


class KVTransfer(msgspec.Struct, frozen=True):
    """KV block copies between the device pool and the prefix cache's offload tiers,
    decided by the KV cache manager and started by the worker when the step starts, in
    field order (gpu/kv_offload.py): spills, saves, fills, loads. The step's forward waits
    for the saves (their blocks are reused) but not for the loads, which may outlast
    several steps: no row reads a loaded block, nor writes one, until the worker has
    reported the load done (StepOutput.kv_loads_done_through; the request waits,
    actors/core/kv_holds.py) or the step waits for it (`wait_loads_through`). Each rank of
    a tensor-parallel group copies its own shard of the same blocks."""

    spill_host_slots: tuple[int, ...] = ()
    """Host slots whose block goes to the disk tier (before a save reuses the slot)."""
    spill_hashes: tuple[bytes, ...] = ()
    save_gpu_block_ids: tuple[int, ...] = ()
    """Device blocks evicted this step, copied into `save_host_slots` before reuse."""
    save_host_slots: tuple[int, ...] = ()
    fill_host_slots: tuple[int, ...] = ()
    """Host slots given a block read back from the disk tier (`fill_data`, checked)."""
    fill_data: tuple[bytes, ...] = ()
    load_host_slots: tuple[int, ...] = ()
    """Host slots copied into the device blocks `load_gpu_block_ids` (prefix hits)."""
    load_gpu_block_ids: tuple[int, ...] = ()
    load_id: int = -1
    """The loads' number (increasing from 0 with each transfer that loads; -1: no loads)."""
    wait_loads_through: int = -1
    """The step's forward waits for every load numbered up to this one, on this rank, this
    transfer's own included (-1: none): for loads rank 0 reported done (so every rank's
    later steps come after them), or that a row of this step reads or a block it reuses."""

    @property
    def is_empty(self) -> bool:
        return not (
            self.spill_host_slots
            or self.save_host_slots
            or self.fill_host_slots
            or self.load_host_slots
            or self.wait_loads_through >= 0
        )


class SchedulerOutput(msgspec.Struct, frozen=True):
    step_id: int
    new_requests: tuple[NewRequestData, ...]
    cached_requests: CachedRequestData
    scheduled_request_ids: tuple[str, ...]
    """Batch order."""
    num_scheduled_tokens: tuple[int, ...]
    """Tokens each scheduled request runs this step, aligned with scheduled_request_ids."""
    num_computed_tokens: tuple[int, ...]
    """Each scheduled request's computed tokens before this step (CPU mirror of GPU state)."""
    samples_token: tuple[bool, ...]
    """Whether this step's chunk reaches the end of the request's known tokens, so the
    sampled token is real (False for a partial prefill chunk)."""
    finished_request_ids: frozenset[str]
    """Rows to free before this step: finished, aborted or preempted requests."""
    schedule_time_s: float = 0.0
    """CPU time the scheduler spent building this step (copied into its StepStats)."""
    grammar_bitmask: GrammarBitmask | None = None
    """Applied to the logits before sampling; None when no row samples under a grammar or
    the mask is deferred."""
    grammar_mask_deferred: bool = False
    """The mask comes after the previous step's tokens (the runner waits for it before
    sampling; the engine core delivers it outside this message)."""
    num_draft_slots: tuple[int, ...] = ()
    """Speculative decoding: per scheduled request, how many of its scheduled tokens are
    draft slots after its last token (0 for prefill chunks and non-speculating rows); the
    runner fills them with the row's drafts. Empty when no request speculates."""
    kv_transfer: KVTransfer | None = None
    """Offload-tier copies to run before this step's forward (None: none)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled_request_ids)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_request_ids


# ==== inside the engine core: GPU actor -> scheduler ===================================


class StepOutput(msgspec.Struct, frozen=True):
    step_id: int
    request_ids: tuple[str, ...]
    """Requests that sampled a real token this step, in batch order."""
    sampled_token_ids: np.ndarray  # [num_sampled] int64, request-major
    logprobs: LogprobsArrays | None
    """Rows aligned with sampled_token_ids; None when no request asked for logprobs."""
    stats: StepStats
    error: str | None = None
    """Set when the step failed; every request in it is finished with reason 'error'."""
    failed_request_ids: tuple[str, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None
    """Of the requests that asked for them and ran prompt tokens in this step."""
    num_sampled_tokens: np.ndarray | None = None  # [len(request_ids)] int32; None: one each
    """Speculative steps: tokens each request emitted (its accepted drafts plus one)."""
    num_draft_tokens: np.ndarray | None = None  # [len(request_ids)] int32
    """Speculative steps: drafts each request verified (0 where it had none)."""
    kv_loads_done_through: int = -1
    """The newest offload load (KVTransfer.load_id) whose copies are done on rank 0's
    device when the step's outputs were read, all earlier ones too (-1: none or no tier)."""


# ==== inside the engine core: the engine loop's mailbox (actors/core/engine_loop.py) ====


class GrammarCompiled(msgspec.Struct, frozen=True):
    """A new request's grammar has compiled, or failed to (from a compile thread)."""

    request_id: str
    client_index: int
    compiled: Any
    """The compile's concurrent.futures.Future, done: its GrammarMatcher or its error."""


class AbortClient(msgspec.Struct, frozen=True):
    """Abort every request of one front end (it restarted: nobody reads them any more) and
    tell its new process how many there were (PredecessorAborted)."""

    client_index: int


class GetSchedulerStats(msgspec.Struct, frozen=True):
    """Asked: answered with a fresh SchedulerStats (finishes since the last step count)."""


class CheckKVInvariants(msgspec.Struct, frozen=True):
    """Asked: answered with None, or fails with the AssertionError naming what is broken."""


class ResetPrefixCache(msgspec.Struct, frozen=True):
    """Asked: drop the prefix cache's blocks that no request holds; answered with
    PrefixCacheReset."""


class Drain(msgspec.Struct, frozen=True):
    """Abort everything queued or running; `drained` (an anyio.Event) is set once no step
    is in flight."""

    drained: Any


ToEngineLoop = (
    EngineRequest
    | AbortRequests
    | GrammarVocab
    | GrammarCompiled
    | AbortClient
    | GetSchedulerStats
    | CheckKVInvariants
    | ResetPrefixCache
    | Drain
)


# ==== inside a front end ===============================================================


class Admit(msgspec.Struct, frozen=True):
    """Asked of the admission actor: admit every engine request of one API request
    (prompts x samples), answered with their streams, or refused."""

    requests: tuple[EngineRequest, ...]
    sampling_params: SamplingParams
    """The API request's parameters, with its `n`."""


class Started(msgspec.Struct, frozen=True):
    """The first output token of these requests arrived."""

    request_ids: tuple[str, ...]


class EngineDone(msgspec.Struct, frozen=True):
    """The engine finished these requests (their readers may not have seen it yet)."""

    request_ids: tuple[str, ...]


class Finished(msgspec.Struct, frozen=True):
    """The readers of these requests are done."""

    request_ids: tuple[str, ...]
    abort: bool = False
    """The reader gave up: abort those the engine still runs."""


class BeginDrain(msgspec.Struct, frozen=True):
    """Refuse new requests with 503 from now on."""


class AbortAll(msgspec.Struct, frozen=True):
    """Abort every admitted request; each stream ends with finish_reason 'abort'."""


class FailAll(msgspec.Struct, frozen=True):
    """End every admitted stream with an error and refuse new requests: for good when the
    engine died; until ResumeAdmission when its core stopped answering (`retryable`)."""

    message: str
    retryable: bool = False
    """The core may come back: the streams' errors say a retry may succeed (HTTP 503)."""


class ResumeAdmission(msgspec.Struct, frozen=True):
    """The engine core answers again after a retryable FailAll: admit requests again."""


class WaitIdle(msgspec.Struct, frozen=True):
    idle: Any
    """An anyio.Event, set once no admitted request is left."""


class GetAdmissionStats(msgspec.Struct, frozen=True):
    """Asked: answered with the admission actor's AdmissionStats."""


ToAdmission = (
    Admit
    | Started
    | EngineDone
    | Finished
    | BeginDrain
    | AbortAll
    | FailAll
    | ResumeAdmission
    | WaitIdle
    | GetAdmissionStats
)


class RegisterRequest(msgspec.Struct, frozen=True):
    """Tells the front end's output processor where a request's output goes, before the
    request is sent to the engine core."""

    request: EngineRequest
    stream: Any
    """The request's actors.frontend.output_stream.RequestStream."""


class FailRequests(msgspec.Struct, frozen=True):
    """End every open request with an error: the engine core is gone."""

    message: str


ToSampler = EngineCoreOutputs | RegisterRequest | AbortRequests | FailRequests


# ==== a front end <-> its grammar checker processes (app/grammar_checker.py) ============


class GrammarCheckerStart(msgspec.Struct, frozen=True, tag="checker_start"):
    """The first message to a checker process: what to compile against (the engine core
    compiles against the same, GrammarVocab)."""

    tokenizer_json: str | None
    """None for a model served without a tokenizer: specs are then only validated."""
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class GrammarCheck(msgspec.Struct, frozen=True, tag="check"):
    """Compile this spec; answered by GrammarVerdict."""

    spec: StructuredOutputSpec


class GrammarVerdict(msgspec.Struct, frozen=True, tag="verdict"):
    error: str | None = None
    """Why the spec does not compile; None when it does."""


ToGrammarChecker = GrammarCheckerStart | GrammarCheck
