"""A real `tandem serve` (Hypercorn on 127.0.0.1, a free port) in a background thread.

The embedded model is loaded once per test session and shared: each test module starts its
own server on it (a second instead of a full load), with the settings it needs. Servers
never overlap in time, since they share the model's KV memory.
"""

from __future__ import annotations

import functools
from typing import Any

from actors.protocol.config import EngineConfig
from app.serve_settings import ServeSettings
from app.server_state import EngineSnapshot
from benchmarks.soak_server import InProcessServer
from tests._embedded_model import embedded_gguf_path

MAX_MODEL_LEN = 2048
# Float32 weights, as transformers computes them: their products do not depend on how many
# rows a step has, so tests that compare outputs across batches, speculation or the prefix
# cache compare like with like (the packed int4 default's tokens can part at a near-tie;
# its own tests are tests/gpu/test_int4_projections.py, and `tandem serve` subprocess tests
# run it).
_ENGINE_OPTIONS: dict[str, Any] = dict(
    device="cpu",
    quantization="none",
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
)
ENGINE = EngineConfig(model="default", **_ENGINE_OPTIONS)


@functools.cache
def shared_llm() -> Any:
    """The embedded model (ENGINE) as an offline LLM, loaded once per session; skips the
    calling test where it is not installed. `LLM("default", reuse=shared_llm(), ...)` runs
    it under other engine options (float32 too) without loading it again."""
    from app.llm import LLM

    embedded_gguf_path()
    llm = LLM(ENGINE.model, **_ENGINE_OPTIONS)
    assert llm.config == ENGINE
    return llm


@functools.cache
def shared_packed_llm() -> Any:
    """The embedded model as `LLM("default")` loads it (on the CPU: its packed int4
    projections), loaded once per session; skips the calling test where it is not
    installed. `LLM("default", reuse=shared_packed_llm(), ...)` runs it under other
    engine options."""
    from app.llm import LLM

    embedded_gguf_path()
    return LLM("default")


def shared_model() -> Any:
    """The embedded model's LoadedEngine, loaded once (shared_llm's); skips the calling
    test where it is not installed."""
    return shared_llm().loaded


class RunningServer(InProcessServer):
    """A server on the session's shared model with the given ServeSettings fields."""

    def __init__(self, preloaded: Any = None, **settings: Any) -> None:
        """`preloaded`: another loaded model (default: the session's embedded one)."""
        engine = settings.pop("engine", ENGINE)
        super().__init__(
            ServeSettings(engine=engine, port=0, **settings),
            preloaded if preloaded is not None else shared_model(),
        )

    def wait_engine_idle(self, timeout_s: float = 30.0) -> EngineSnapshot:
        return self.wait_idle(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Drain and stop; the server must exit cleanly (code 0)."""
        exit_code = super().stop(timeout_s)
        assert exit_code == 0, exit_code
        return exit_code


def openai_client(server: RunningServer) -> Any:
    """The official openai client on `server` (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
