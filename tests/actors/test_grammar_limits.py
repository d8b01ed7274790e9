"""Budgets that hold a spec before the grammar library compiles it: nesting through $refs,
Lark rule counts, alternatives per rule; and a spec at the budget compiling on the compile
threads' stack."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from actors.core.grammar import GrammarError, grammar_definition
from actors.core.grammar_limits import (
    MAX_ALTERNATIVES,
    MAX_GRAMMAR_RULES,
    MAX_SCHEMA_DEPTH,
    GrammarLimitError,
    check_json_schema,
    check_lark_grammar,
)
from actors.protocol.structured_output import StructuredOutputSpec


def ref_chain(num_definitions: int) -> dict[str, Any]:
    """Objects each holding the next through a $ref: what crashed the compiler at 1,000."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["x"],
        }
        for i in range(num_definitions)
    }
    defs[f"d{num_definitions}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(num_rules: int) -> str:
    return "\n".join(
        ["start: r0", *(f"r{i}: r{i + 1}" for i in range(num_rules)), f'r{num_rules}: "a"']
    )


def test_a_deep_ref_chain_is_over_budget_and_a_recursive_schema_is_not() -> None:
    with pytest.raises(GrammarLimitError, match=f"at most {MAX_SCHEMA_DEPTH}"):
        check_json_schema(ref_chain(1000))
    check_json_schema(ref_chain(100))
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    check_json_schema(tree)  # recursion compiles to a recursive rule, not to depth
    with pytest.raises(GrammarError, match="nests"):
        grammar_definition(StructuredOutputSpec("json", json.dumps(ref_chain(1000))))


def test_too_many_alternatives_or_rules_are_over_budget() -> None:
    wide = {"anyOf": [{"type": "integer", "minimum": i} for i in range(MAX_ALTERNATIVES + 1)]}
    with pytest.raises(GrammarLimitError, match="'anyOf' has 2001 alternatives"):
        check_json_schema({"type": "object", "properties": {"a": wide}})
    check_json_schema({"anyOf": wide["anyOf"][:MAX_ALTERNATIVES]})
    with pytest.raises(GrammarLimitError, match=f"at most {MAX_GRAMMAR_RULES}"):
        check_lark_grammar(lark_chain(3000))
    check_lark_grammar(lark_chain(MAX_GRAMMAR_RULES - 2))
    many = "start: " + " | ".join(f'"a{i}"' for i in range(MAX_ALTERNATIVES + 1))
    with pytest.raises(GrammarLimitError, match="rule 'start' has 2001 alternatives"):
        check_lark_grammar(many)


def test_bars_in_literals_and_comments_are_not_alternatives() -> None:
    literals = (
        'start: "' + "|" * 3000 + '" /a' + "\\|" * 3000 + "/ // " + "|" * 3000 + '\nother: "x"'
    )
    check_lark_grammar(literals)
    with pytest.raises(GrammarError, match="rules and terminals"):  # GBNF counts after conversion
        grammar_definition(
            StructuredOutputSpec(
                "grammar",
                "\n".join(
                    ["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(3000)), 'r3000 ::= "a"']
                ),
            )
        )


_COMPILE_BEYOND_BUDGET = """
import json, sys
import actors.core.grammar_limits as limits
from actors.core.grammar import CompileThreads, check_spec
from actors.protocol.structured_output import StructuredOutputSpec
from tests.actors.test_grammar_limits import lark_chain, ref_chain
limits.MAX_SCHEMA_DEPTH = limits.MAX_GRAMMAR_RULES = 10**9
specs = [StructuredOutputSpec("json", json.dumps(ref_chain(1500))),
         StructuredOutputSpec("grammar", lark_chain(3000))]
if sys.argv[1] == "8MiB":
    import threading
    threading.stack_size(8 << 20)  # a common default for a thread, and for the main one
    thread = threading.Thread(target=lambda: [check_spec(spec) for spec in specs])
    thread.start()
    thread.join()
else:
    threads = CompileThreads(1, "check")
    for spec in specs:
        threads.submit(lambda: check_spec(spec)).result()
print("compiled")
"""


def test_the_compile_stack_holds_specs_several_times_over_the_budget() -> None:
    # Each in a process of its own: a stack overflow kills the process. Specs past what
    # overflows the library on an 8 MiB stack (measured: ~1,000 $ref'd objects, ~3,000
    # chained rules) compile on the compile threads' stack.
    def compile_on(where: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _COMPILE_BEYOND_BUDGET, where],
            capture_output=True,
            text=True,
            timeout=300,
        )

    deep = compile_on("compile-threads")
    assert deep.returncode == 0 and "compiled" in deep.stdout, deep.stderr[-2000:]
    assert compile_on("8MiB").returncode != 0  # what the budgets keep from ever happening
