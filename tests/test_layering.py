"""The layering a reader can trust, checked: config and the protocol are leaf modules; the
packages follow the process boundary (actors/protocol is all that the engine core, the
front end and gpu/ share; the core never imports the front end nor the front end the core;
gpu/ knows only the protocol); the engine side never imports the front end, and the front
end never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "actors", "gpu", "kernels", "telemetry", "benchmarks")
LEAVES = {
    "actors/protocol/config.py": {"actors.protocol.speculative_config"},
    "actors/protocol/speculative_config.py": set(),
    "actors/protocol/model_source.py": set(),
    "actors/protocol/structured_output.py": set(),
    "actors/protocol/sampling_params.py": {"actors.protocol.structured_output"},
    "actors/protocol/messages.py": {
        "actors.protocol.sampling_params",
        "actors.protocol.structured_output",
    },
    "actors/protocol/codec.py": {"actors.protocol.messages"},
}
"""Leaf module -> the project modules it may import (nothing else of the project)."""
FRONT_END_MODULES = (
    "app.cli",
    "app.serve_cmd",
    "app.server",
    "app.server_state",
    "app.routes_openai",
    "app.routes_admin",
    "app.api_server_proc",
    "app.supervisor",
    "app.engine_connection",
    "app.tokenizer_loader",
    "actors.frontend.engine_client",
    "actors.frontend.admission",
    "actors.frontend.sampler",
    "actors.protocol.transport",
)
SIDES = {
    "actors/protocol": ("actors.protocol", "telemetry"),
    "actors/frontend": ("actors.protocol", "actors.frontend", "telemetry"),
    "actors/core": ("actors.protocol", "actors.core", "gpu", "kernels", "telemetry"),
    "gpu": ("actors.protocol", "gpu", "kernels", "telemetry"),
}
"""Package -> the only project packages its modules may import."""


def _project_imports(path: Path) -> set[str]:
    """Every project module `path` imports, at any depth of the file (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        found.update(name for name in names if name.split(".")[0] in PACKAGES)
    return found


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_config_and_protocol_are_leaf_modules(leaf: str) -> None:
    assert _project_imports(ROOT / leaf) <= LEAVES[leaf]


@pytest.mark.parametrize("package", sorted(SIDES))
def test_packages_follow_the_process_boundary(package: str) -> None:
    allowed = SIDES[package]
    offenders = {
        str(path.relative_to(ROOT)): sorted(imports)
        for path in _modules(package)
        if (
            imports := {
                m
                for m in _project_imports(path)
                if not any(m == a or m.startswith(a + ".") for a in allowed)
            }
        )
    }
    assert not offenders


def test_only_the_in_process_engine_joins_the_core_and_a_front_end() -> None:
    joined = [
        str(path.relative_to(ROOT))
        for path in _modules("actors")
        if {
            m.split(".")[1]
            for m in _project_imports(path)
            if m.startswith("actors.") and m.count(".") >= 2
        }
        >= {"core", "frontend"}
    ]
    assert joined == ["actors/inprocess_engine.py"]


def test_the_product_never_imports_the_benchmarks() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imports)
        for package in ("app", "actors", "gpu", "kernels", "telemetry")
        for path in _modules(package)
        if (imports := {m for m in _project_imports(path) if m.startswith("benchmarks")})
    }
    assert not offenders


@pytest.mark.parametrize("package", ["gpu", "kernels", "telemetry", "actors"])
def test_the_engine_side_never_imports_the_front_end(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imports)
        for path in _modules(package)
        if (
            imports := {
                m for m in _project_imports(path) if m.split(".")[0] in ("app", "benchmarks")
            }
        )
    }
    assert not offenders


def test_kernels_import_none_of_the_packages() -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(i)
        for p in _modules("kernels")
        if (i := {m for m in _project_imports(p) if not m.startswith("kernels")})
    }
    assert not offenders


def test_the_front_end_does_not_import_torch() -> None:
    """Everything an API server loads to serve, and the command line itself; reading the
    tokenizer from a GGUF file loads no torch either."""
    code = (
        "import sys\n"
        + "".join(f"import {module}\n" for module in FRONT_END_MODULES)
        + "app.cli.build_parser()\n"
        + "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'triton', 'gpu', 'kernels') or m == 'actors.core.engine_core')\n"
        + "app.tokenizer_loader.load_tokenizer('default')\n"
        + "heavy += sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        + "print(heavy)\nsys.exit(1 if heavy else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_circles() -> list[list[str]]:
    """Import circles between the product's files (lazy and TYPE_CHECKING imports count: a
    reader follows them too), as strongly connected components of more than one file."""
    modules = {
        _module_name(path): path
        for package in PACKAGES
        if package != "benchmarks"
        for path in _modules(package)
    }
    edges = {
        name: {m for m in _project_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str, graph: dict[str, set[str]], out: list[str]) -> None:
        stack = [(name, iter(sorted(graph[name])))]
        seen.add(name)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                out.append(node)
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(sorted(graph[child]))))

    for name in sorted(edges):
        if name not in seen:
            visit(name, edges, order)
    reverse: dict[str, set[str]] = {name: set() for name in edges}
    for name, targets in edges.items():
        for target in targets:
            reverse[target].add(name)
    seen.clear()
    circles = []
    for name in reversed(order):
        if name not in seen:
            component: list[str] = []
            visit(name, reverse, component)
            if len(component) > 1:
                circles.append(sorted(component))
    return circles


def test_no_file_imports_itself_through_others() -> None:
    assert _file_circles() == []


def test_the_circle_finder_finds_a_circle(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _project_imports

    def with_a_circle(path: Path) -> set[str]:
        extra = {"kernels.rms_norm"} if path.name == "silu_mul.py" else set()
        extra |= {"kernels.silu_mul"} if path.name == "rms_norm.py" else set()
        return real(path) | extra

    monkeypatch.setattr(sys.modules[__name__], "_project_imports", with_a_circle)
    assert ["kernels.rms_norm", "kernels.silu_mul"] in _file_circles()
