"""The front end's grammar checker processes: verdicts, the time budget, a checker that dies
or whose client leaves mid-compile, the verdict cache, and a pool that stays busy."""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import anyio
import pytest

from actors.protocol.messages import GrammarCheckerStart
from actors.protocol.structured_output import StructuredOutputSpec
from app.grammar_checker import GrammarChecker, GrammarCheckerUnavailable
from app.tokenizer_loader import load_tokenizer
from tests._embedded_model import needs_embedded_model
from tests.actors.test_grammar_limits import lark_chain, ref_chain

pytestmark = needs_embedded_model  # every checker here starts on the embedded tokenizer


@functools.cache
def _start() -> GrammarCheckerStart:
    tokenizer = load_tokenizer("default")
    assert tokenizer is not None
    return GrammarCheckerStart(
        tokenizer.raw.to_str(), tokenizer.vocab_size, tuple(tokenizer.eos_token_ids)
    )


def slow_schema(num_patterns: int = 300) -> StructuredOutputSpec:
    """Compiles for seconds (the library's time grows steeply with the patterns)."""
    return StructuredOutputSpec(
        "json",
        json.dumps(
            {
                "type": "object",
                "patternProperties": {
                    f"^p{i}[a-z]*{i}$": {"type": "integer"} for i in range(num_patterns)
                },
            }
        ),
    )


def _run(test: Any, **options: Any) -> Any:
    async def run() -> Any:
        checker = GrammarChecker(_start, **options)
        try:
            return await test(checker)
        finally:
            await checker.aclose()

    return anyio.run(run)


def test_verdicts_name_what_is_wrong_and_repeat_from_the_cache() -> None:
    async def test(checker: GrammarChecker) -> None:
        assert await checker.check(StructuredOutputSpec("json", '{"type":"object"}')) is None
        assert "unclosed group" in await checker.check(StructuredOutputSpec("regex", "("))
        assert "at most 1024" in await checker.check(
            StructuredOutputSpec("json", json.dumps(ref_chain(1000)))
        )
        assert "at most 1000" in await checker.check(
            StructuredOutputSpec("grammar", lark_chain(3000))
        )
        # Thousands of objects to choose from: fine to compile, but the parser's row
        # outgrows its limit once the output starts; found before any token is sampled.
        tools = StructuredOutputSpec(
            "json",
            json.dumps(
                {
                    "anyOf": [
                        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
                        for i in range(1500)
                    ]
                }
            ),
        )
        assert "max is 2000" in await checker.check(tools)
        idle = list(checker._idle)
        started = time.perf_counter()
        assert "max is 2000" in await checker.check(tools)  # from the cache
        assert time.perf_counter() - started < 0.05 and checker._idle == idle

    _run(test)


def test_a_compile_past_the_time_budget_is_refused_and_its_process_replaced() -> None:
    async def test(checker: GrammarChecker) -> None:
        await checker.check(StructuredOutputSpec("regex", "[a-z]+"))  # started
        (first,) = checker._idle
        started = time.perf_counter()
        error = await checker.check(slow_schema())
        assert error is not None and "--grammar-compile-timeout" in error
        assert time.perf_counter() - started < 1.0 + 5.0
        assert first.process.returncode is not None and not checker._idle
        assert await checker.check(StructuredOutputSpec("regex", "[0-9]+")) is None
        # A verdict of the clock is not kept: the spec is compiled again next time.
        assert "--grammar-compile-timeout" in await checker.check(slow_schema())

    _run(test, timeout_s=1.0)


def test_a_checker_that_dies_mid_compile_refuses_its_spec_and_the_next_one_is_served() -> None:
    async def test(checker: GrammarChecker) -> None:
        await checker.check(StructuredOutputSpec("regex", "[a-z]+"))
        (busy,) = checker._idle

        async def kill_soon() -> None:
            await anyio.sleep(0.3)
            busy.process.kill()  # as a stack overflow would end it

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            error = await checker.check(slow_schema())
        assert error is not None and "crashed" in error
        assert await checker.check(StructuredOutputSpec("regex", "[0-9]+")) is None

    _run(test, timeout_s=60.0)


def test_a_check_whose_client_left_kills_its_process() -> None:
    async def test(checker: GrammarChecker) -> None:
        await checker.check(StructuredOutputSpec("regex", "[a-z]+"))
        (busy,) = checker._idle
        with anyio.move_on_after(0.3):
            await checker.check(slow_schema())
        assert busy.process.returncode is not None and not checker._idle
        assert await checker.check(StructuredOutputSpec("regex", "[0-9]+")) is None

    _run(test, timeout_s=60.0)


def test_a_pool_that_stays_busy_refuses_rather_than_queueing_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forever = anyio.Event()

    async def hang(self: GrammarChecker, payload: bytes) -> tuple[str | None, bool]:
        await forever.wait()
        return None, True

    monkeypatch.setattr(GrammarChecker, "_compile", hang)

    async def test(checker: GrammarChecker) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(checker.check, StructuredOutputSpec("regex", "a"))
            await anyio.sleep(0.1)
            with pytest.raises(GrammarCheckerUnavailable, match="busy"):
                await checker.check(StructuredOutputSpec("regex", "b"))
            forever.set()

    _run(test, num_processes=1, timeout_s=0.5)
