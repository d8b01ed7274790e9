"""Budgets a structured-output spec must fit before the grammar library sees it.

The grammar library compiles rule references and `$ref` chains by native recursion: a
chain deep enough (about 1,000 `$ref`-linked objects, or 3,000 chained Lark rules, on an
8 MiB stack) overflows the stack and kills the process, with no exception to catch. Its
parser also refuses, at run time and only once a token has been sampled, a row of more
than MAX_ALTERNATIVES items (a rule with that many alternatives). Both are checked here in
plain Python on the spec's text, so a spec over budget is refused naming the limit, and
compiles always run on a stack (COMPILE_STACK_BYTES) dozens of times deeper than any spec
within budget needs.

    check_json_schema(schema)      # raises GrammarLimitError naming the limit
    check_lark_grammar(lark_text)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

MAX_SCHEMA_DEPTH = 1024
"""Most nested JSON values along any path of a schema, `$ref`s followed (a recursive
reference ends a path: it compiles to a recursive rule, not to more nesting)."""
MAX_GRAMMAR_RULES = 1000
"""Most rule and terminal definitions in a Lark grammar (a GBNF one after conversion): a
chain of references can be no longer."""
MAX_ALTERNATIVES = 2000
"""Most alternatives in one `anyOf`/`oneOf` or one grammar rule: the grammar library's
limit on one parser row (its `max_items_in_row`)."""
COMPILE_STACK_BYTES = 256 << 20
"""Stack of every thread that compiles a grammar (the engine core's and the front end's
checker alike). At MAX_SCHEMA_DEPTH / MAX_GRAMMAR_RULES a compile needs a few MiB; only
the pages touched are ever committed."""

_RULE_DEFINITION = re.compile(
    r"^[ \t]*[?!]?([A-Za-z_][A-Za-z_0-9]*)[ \t]*(?:\.[ \t]*-?[0-9]+)?"
    r"[ \t]*(?:\{[^}\n]*\})?[ \t]*:",
    re.MULTILINE,
)
_LARK_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*')


class GrammarLimitError(ValueError):
    """A spec over one of the budgets above; the message names the limit."""


def check_json_schema(schema: Any) -> None:
    """GrammarLimitError when `schema` (decoded JSON) nests deeper than MAX_SCHEMA_DEPTH
    with its local `$ref`s followed, or has an `anyOf`/`oneOf` of more than
    MAX_ALTERNATIVES branches."""
    for node in _containers(schema):
        if isinstance(node, dict):
            for keyword in ("anyOf", "oneOf"):
                branches = node.get(keyword)
                if isinstance(branches, list) and len(branches) > MAX_ALTERNATIVES:
                    raise GrammarLimitError(
                        f"'{keyword}' has {len(branches)} alternatives; at most "
                        f"{MAX_ALTERNATIVES} are allowed"
                    )
    depth = _expanded_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarLimitError(
            f"the schema nests {depth} levels deep with its $refs "
            f"followed; at most {MAX_SCHEMA_DEPTH} are allowed"
        )


def check_lark_grammar(text: str) -> None:
    """GrammarLimitError when the Lark grammar defines more than MAX_GRAMMAR_RULES rules and
    terminals, or one of them has more than MAX_ALTERNATIVES alternatives."""
    code = _LARK_LITERAL.sub('""', text)  # a '|' or ':' inside a literal is not syntax
    starts = [match.start() for match in _RULE_DEFINITION.finditer(code)]
    if len(starts) > MAX_GRAMMAR_RULES:
        raise GrammarLimitError(
            f"the grammar defines {len(starts)} rules and terminals; at "
            f"most {MAX_GRAMMAR_RULES} are allowed"
        )
    for start, end in zip(starts, [*starts[1:], len(code)]):
        num_alternatives = code.count("|", start, end) + 1
        if num_alternatives > MAX_ALTERNATIVES:
            name = _RULE_DEFINITION.match(code, start).group(1)  # type: ignore[union-attr]
            raise GrammarLimitError(
                f"rule '{name}' has {num_alternatives} alternatives; at "
                f"most {MAX_ALTERNATIVES} are allowed"
            )


def _containers(value: Any) -> Iterator[Any]:
    """Every dict and list inside `value`, itself included (no recursion: a schema may be
    as deep as the body's JSON decoder allows)."""
    pending = [value]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            yield node
            pending.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            yield node
            pending.extend(v for v in node if isinstance(v, (dict, list)))


def _children(node: Any, root: Any) -> list[Any]:
    values = node.values() if isinstance(node, dict) else node
    children = [v for v in values if isinstance(v, (dict, list))]
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        target = _resolve(root, node["$ref"])
        if target is not None:
            children.append(target)
    return children


def _expanded_depth(root: Any) -> int:
    """Longest path of nested containers from `root`, into `$ref` targets too; a container
    already on the path counts nothing (recursion). Iterative, each container's depth
    computed once."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, list[Any]]] = []

    def enter(node: Any) -> None:
        on_path.add(id(node))
        stack.append((node, _children(node, root)))

    if isinstance(root, (dict, list)):
        enter(root)
    while stack:
        node, children = stack[-1]
        while children and (id(children[-1]) in depth or id(children[-1]) in on_path):
            children.pop()
        if children:
            enter(children.pop())
            continue
        stack.pop()
        on_path.discard(id(node))
        depth[id(node)] = 1 + max((depth.get(id(c), 0) for c in _children(node, root)), default=0)
    return depth.get(id(root), 0)


def _resolve(root: Any, ref: str) -> Any:
    """The container a local JSON pointer (`#/$defs/name`) names; None for anything else."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None
