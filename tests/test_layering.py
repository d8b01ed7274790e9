"""The layering a reader can trust, checked: config and the protocol are leaf modules, the
engine side never imports the front end, and the front end never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "actors", "gpu", "kernels", "telemetry", "benchmarks")
LEAVES = {"actors/config.py": {"actors.speculative_config"},
          "actors/speculative_config.py": set(), "actors/model_source.py": set(),
          "actors/structured_output.py": set(),
          "actors/sampling_params.py": {"actors.structured_output"},
          "actors/messages.py": {"actors.sampling_params", "actors.structured_output"},
          "actors/codec.py": {"actors.messages"}}
"""Leaf module -> the project modules it may import (nothing else of the project)."""
FRONT_END_MODULES = ("app.cli", "app.serve_cmd", "app.server", "app.server_state",
                     "app.routes_openai", "app.routes_admin", "app.api_server_proc",
                     "app.supervisor", "app.engine_connection", "app.tokenizer_loader",
                     "actors.engine_client", "actors.admission", "actors.sampler",
                     "actors.transport")


def _project_imports(path: Path) -> set[str]:
    """Every project module `path` imports, at any depth of the file (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found.update(name for name in names if name.split(".")[0] in PACKAGES)
    return found


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_config_and_protocol_are_leaf_modules(leaf: str) -> None:
    assert _project_imports(ROOT / leaf) <= LEAVES[leaf]


@pytest.mark.parametrize("package", ["gpu", "kernels", "telemetry", "actors"])
def test_the_engine_side_never_imports_the_front_end(package: str) -> None:
    offenders = {str(path.relative_to(ROOT)): sorted(imports) for path in _modules(package)
                 if (imports := {m for m in _project_imports(path)
                                 if m.split(".")[0] in ("app", "benchmarks")})}
    assert not offenders


def test_kernels_import_none_of_the_packages() -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(i) for p in _modules("kernels")
                 if (i := {m for m in _project_imports(p) if not m.startswith("kernels")})}
    assert not offenders


def test_the_front_end_does_not_import_torch() -> None:
    """Everything an API server loads to serve, and the command line itself; reading the
    tokenizer from a GGUF file loads no torch either."""
    code = ("import sys\n"
            + "".join(f"import {module}\n" for module in FRONT_END_MODULES)
            + "app.cli.build_parser()\n"
            + "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
              "('torch', 'triton', 'gpu', 'kernels') or m == 'actors.engine_core')\n"
            + "app.tokenizer_loader.load_tokenizer('default')\n"
            + "heavy += sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
            + "print(heavy)\nsys.exit(1 if heavy else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
