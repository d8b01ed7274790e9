"""Offline Python API.

    from app.llm import LLM
    from actors.protocol.sampling_params import SamplingParams

    llm = LLM(model="default")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    print(outputs[0].outputs[0].text)

The same actors as `tandem serve` run underneath, on a private event loop per call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from actors.core.engine_startup import LoadedEngine, load_engine, reuse_engine
from actors.core.kv_claims import KeptPrefixCache
from actors.frontend.admission import child_sampling_params
from actors.frontend.generation_defaults import check_logprobs_within, logprobs_limit
from actors.frontend.output_stream import RequestStream
from actors.inprocess_engine import InProcessEngine
from actors.protocol.config import ConfigError, EngineConfig
from actors.protocol.messages import EngineRequest, PromptEmbeds, StepStats
from actors.protocol.prompt_embeds import check_embeds
from actors.protocol.sampling_params import SamplingParams
from app.harmony.render import render_prompt
from app.prompt_embeds import placeholder_token_ids
from app.tokenizer import Tokenizer
from app.tokenizer_loader import load_tokenizer
from gpu.distributed.external_launcher import follower_of
from gpu.prompt_embeds import embeds_from_tensor

Prompt = str | Sequence[int] | Mapping[str, Any]
"""Text, token ids, or {"prompt_embeds": tensor [num_tokens, hidden_size]} (vLLM's
EmbedsPrompt; needs enable_prompt_embeds=True)."""
_ReadyPrompt = str | Sequence[int] | PromptEmbeds


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int
    runner: str
    prompt_logprobs: tuple[Any, ...] | None = None
    """With SamplingParams.prompt_logprobs: one LogprobEntry per prompt token (None first)."""


class LLM:
    def __init__(
        self, model: str = "default", *, reuse: LLM | None = None, **engine_options: Any
    ) -> None:
        """`reuse` shares another LLM's loaded model (same weights, KV memory and device)
        under different engine options: runner, scheduling limits, a smaller KV pool."""
        self.config = EngineConfig(model=model, **engine_options)
        if self.config.data_parallel_size != 1:
            raise ConfigError("data_parallel_size is `tandem serve`'s: the LLM runs one core")
        if reuse is None:
            self.loaded: LoadedEngine = load_engine(self.config)
        else:
            self.loaded = reuse_engine(reuse.loaded, self.config)
        self.worker = self.loaded.worker
        self._owns_worker = reuse is None
        self._follower = follower_of(self.worker)
        """On a rank other than 0 under an external launcher (torchrun): it repeats rank
        0's steps in `generate` and returns rank 0's outputs."""
        self.tokenizer: Tokenizer | None = (
            reuse.tokenizer
            if reuse is not None
            else load_tokenizer(self.config.model, self.config.tokenizer)
        )
        self.eos_token_ids: tuple[int, ...] = (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        )
        self._next_id = 0
        self._prefix_cache: KeptPrefixCache | None = None
        """The last call's prefix cache, which the next call's engine goes on with."""
        self.last_num_preemptions = 0
        self.last_step_stats: tuple[StepStats, ...] = ()

    def close(self) -> None:
        """Stop the model's tensor-parallel worker processes (nothing to stop on one
        device); a tensor-parallel LLM cannot generate afterwards. Safe to call twice."""
        if not self._owns_worker:
            return
        if self._follower is not None:
            if not self._follower.shut_down:
                self._follower.follow()  # until rank 0 shuts the ranks down
            if self.worker.tp_group is not None:
                self.worker.tp_group.close()
        self.worker.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def rank(self) -> int:
        """This process's rank among the engine's (0 unless torchrun started several)."""
        group = self.worker.tp_group
        return 0 if group is None else group.rank

    @property
    def runner(self) -> str:
        return self.loaded.runner.runner

    @property
    def runner_reason(self) -> str:
        return self.loaded.runner.reason

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache that earlier `generate` calls filled (as vLLM's
        `LLM.reset_prefix_cache`): the next call computes every prompt whole."""
        if self._prefix_cache is not None:
            self._prefix_cache.kv.reset_prefix_cache()
            self._prefix_cache.kv.reset_offload_tiers()

    def apply_chat_template(self, prompt: str) -> str:
        """`prompt` as one user turn of the model's chat, as text (a gpt-oss model's in its
        harmony format). To generate from, prefer `chat_prompt`."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: it has no chat to render")
        prompt_ids = _harmony_prompt_ids(self.tokenizer, prompt)
        if prompt_ids is not None:
            return self.tokenizer.decode(prompt_ids)
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )

    def chat_prompt(self, prompt: str) -> Prompt:
        """`prompt` as one user turn of the model's chat, ready for `generate`: the chat
        template's text, or a gpt-oss model's harmony rendering as token ids (text the user
        wrote stays text, even where it spells a special token)."""
        prompt_ids = _harmony_prompt_ids(self.tokenizer, prompt)
        return prompt_ids if prompt_ids is not None else self.apply_chat_template(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (text, a list of token ids, or {"prompt_embeds": tensor}) and
        return outputs in input order. The prefix cache lasts from call to call (a later
        call reuses the blocks an earlier one computed, its outputs' included) until
        `reset_prefix_cache`, or until another LLM sharing this one's model runs."""
        prompt_list = [self._ready(p) for p in _as_prompt_list(prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompt_list)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        if self.tokenizer is None:
            _check_token_id_only(prompt_list, params_list)
        limit = logprobs_limit(self.config.max_logprobs, self.worker.model_config.vocab_size)
        for prompt, params in zip(prompt_list, params_list):
            check_logprobs_within(params, limit)
            if isinstance(prompt, PromptEmbeds) and params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs are not computed for prompt embeddings")
        if self._follower is not None:  # rank 0 runs the same call: take its outputs
            return list(self._follower.follow() or ())
        results = anyio.run(self._generate, prompt_list, params_list, on_finished)
        leader = self.worker.tp_leader
        if leader is not None and self.config.distributed_executor_backend == "external_launcher":
            leader.send_result(results)  # the launched ranks return these
        return results

    def _ready(self, prompt: Prompt) -> _ReadyPrompt:
        """`prompt` as the engine takes it: an EmbedsPrompt decoded and checked."""
        if not isinstance(prompt, Mapping):
            return prompt
        if set(prompt) != {"prompt_embeds"}:
            raise ValueError(
                "a prompt given as a dict takes exactly the key 'prompt_embeds', "
                f"got {sorted(prompt)}"
            )
        if not self.config.enable_prompt_embeds:
            raise ValueError("prompt embeddings need LLM(..., enable_prompt_embeds=True)")
        embeds = embeds_from_tensor(prompt["prompt_embeds"])
        check_embeds(embeds, self.worker.model_config.hidden_size, self.worker.max_model_len - 1)
        return embeds

    async def _generate(
        self,
        prompts: list[_ReadyPrompt],
        params: list[SamplingParams],
        on_finished: Callable[[RequestOutput], None] | None,
    ) -> list[RequestOutput]:
        engine = InProcessEngine(
            self.worker,
            self.loaded.runner,
            self.config,
            tokenizer=self.tokenizer,
            kept_prefix_cache=self._prefix_cache,
        )
        results: list[RequestOutput | None] = [None] * len(prompts)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            async with anyio.create_task_group() as requests_tg:
                for i, (prompt, p) in enumerate(zip(prompts, params)):
                    requests_tg.start_soon(
                        self._run_one, engine, i, prompt, p, results, on_finished
                    )
            engine.stop()
        self._prefix_cache = engine.core.prefix_cache
        self.last_num_preemptions = engine.num_preemptions_total
        self.last_step_stats = engine.recent_step_stats()
        return [r for r in results if r is not None]

    async def _run_one(
        self,
        engine: InProcessEngine,
        index: int,
        prompt: _ReadyPrompt,
        params: SamplingParams,
        results: list[RequestOutput | None],
        on_finished: Callable[[RequestOutput], None] | None,
    ) -> None:
        embeds = prompt if isinstance(prompt, PromptEmbeds) else None
        if isinstance(prompt, str):
            assert self.tokenizer is not None  # generate() refuses text without one
            token_ids = tuple(self.tokenizer.encode(prompt))
        elif embeds is not None:
            token_ids = placeholder_token_ids(embeds)
        else:
            token_ids = tuple(prompt)
        request_id = f"offline-{self._next_id}"
        self._next_id += 1
        collected: list[_Collected] = []
        async with anyio.create_task_group() as tg:
            for sample in range(params.n):
                request = EngineRequest(
                    request_id=f"{request_id}-{sample}",
                    prompt_token_ids=token_ids,
                    sampling_params=child_sampling_params(params, sample),
                    arrival_time=time.monotonic(),
                    eos_token_ids=self.eos_token_ids,
                    prompt_embeds=embeds,
                )
                tg.start_soon(_collect, engine.add_request(request), sample, collected)
        collected.sort(key=lambda c: c.output.index)
        result = RequestOutput(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=() if embeds is not None else token_ids,
            outputs=tuple(c.output for c in collected),
            num_cached_tokens=max(c.num_cached_tokens for c in collected),
            runner=self.runner,
            prompt_logprobs=collected[0].prompt_logprobs if collected else None,
        )
        results[index] = result
        if on_finished is not None:
            on_finished(result)


@dataclass(frozen=True, slots=True)
class _Collected:
    output: CompletionOutput
    num_cached_tokens: int
    prompt_logprobs: tuple[Any, ...] | None


async def _collect(stream: RequestStream, index: int, collected: list[_Collected]) -> None:
    delta = await stream.wait_finished()
    if delta is None:  # closed without an outcome; nothing to report
        return
    collected.append(
        _Collected(
            CompletionOutput(
                index=index,
                text=delta.text,
                token_ids=delta.token_ids,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
                logprobs=delta.logprobs or None,
            ),
            delta.num_cached_tokens,
            delta.prompt_logprobs,
        )
    )


def _harmony_prompt_ids(tokenizer: Tokenizer | None, prompt: str) -> list[int] | None:
    """A gpt-oss model's prompt ids for one user turn; None for other models."""
    if tokenizer is None or tokenizer.harmony is None:
        return None
    return render_prompt(tokenizer.harmony.encoding, [{"role": "user", "content": prompt}])


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _check_token_id_only(prompts: list[_ReadyPrompt], params: list[SamplingParams]) -> None:
    """A model without a tokenizer (dummy weights) takes token ids and returns token ids."""
    if any(isinstance(p, str) for p in prompts):
        raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
    if any(p.stop for p in params):
        raise ValueError("this model has no tokenizer: stop strings cannot be matched")
