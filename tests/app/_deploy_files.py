"""Readers for the Dockerfile and deploy/ manifests, and the server facts they are checked
against (routes, `tandem serve` flags and their environment variables, exported metrics),
for tests/app/test_deploy_manifests.py."""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import yaml  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
COMPOSE_DIR = ROOT / "deploy" / "compose"
DASHBOARD_PATH = ROOT / "deploy" / "grafana" / "tandem-dashboard.json"

_FROM_OUTSIDE = "value-set-outside-the-manifest"
"""Stands in for values a manifest takes from a Secret or the shell."""
_TRUE_VALUES = ("1", "true", "yes", "on")
_FALSE_VALUES = ("", "0", "false", "no", "off")

# ---- the server -------------------------------------------------------------------------


@functools.cache
def serve_routes() -> frozenset[str]:
    """Paths of the real app's routes that answer GET (what probes and scrapers send)."""
    from actors.protocol.config import EngineConfig
    from app.server import create_app
    from app.server_state import ServerState, ServeSettings

    app = create_app(ServerState(ServeSettings(engine=EngineConfig())))
    return frozenset(
        getattr(route, "path", "")
        for route in app.routes
        if "GET" in (getattr(route, "methods", None) or ())
    )


def _serve_parser() -> argparse.ArgumentParser:
    from app.cli import build_parser

    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    parser: argparse.ArgumentParser = subparsers.choices["serve"]
    return parser


def serve_args(env: Mapping[str, str | None], argv: tuple[str, ...] = ()) -> argparse.Namespace:
    """`tandem serve [argv]` parsed in an environment holding exactly `env`'s TANDEM_*
    (None values, set outside the manifest, are left out)."""
    with mock.patch.dict(os.environ):
        for name in [n for n in os.environ if n.startswith("TANDEM_")]:
            del os.environ[name]
        os.environ.update(
            {k: v for k, v in env.items() if k.startswith("TANDEM_") and v is not None}
        )
        return _serve_parser().parse_args(list(argv))


def flag_action(env_name: str) -> argparse.Action | None:
    """The `tandem serve` option whose environment variable `env_name` would be."""
    if not env_name.startswith("TANDEM_"):
        return None
    dest = env_name.removeprefix("TANDEM_").lower()
    return next((a for a in _serve_parser()._actions if a.dest == dest and a.option_strings), None)


def env_flag_mismatch(name: str, value: str | None) -> str | None:
    """None when setting `name=value` has the same effect as passing the matching flag;
    otherwise what is wrong. `value` None: the manifest takes it from elsewhere."""
    from actors.core.engine_startup import RUNNER_ENV
    from gpu.runner_selection import parse_runner_env

    if name == RUNNER_ENV:
        return (
            None
            if value is None or parse_runner_env(value) is not None
            else (f"{name}={value!r} forces no runner")
        )
    action = flag_action(name)
    if action is None:
        return f"{name} is not the environment variable of any `tandem serve` flag"
    if value is None:
        if action.nargs == 0 or action.type is not None:
            return f"{name} comes from outside the manifest but is not a free-form string"
        value = _FROM_OUTSIDE
    option = action.option_strings[0]
    if action.nargs == 0 and value.strip().lower() not in _TRUE_VALUES + _FALSE_VALUES:
        return f"{name}={value!r} is neither true (1, true, yes, on) nor false"
    if action.nargs == 0:
        argv: tuple[str, ...] = (option,) if value.strip().lower() in _TRUE_VALUES else ()
    elif action.nargs == "+":
        argv = (option, *[v.strip() for v in value.split(",") if v.strip()])
    else:
        argv = (option, value)
    try:
        from_env = getattr(serve_args({name: value}), action.dest)
        from_flag = getattr(serve_args({}, argv), action.dest)
    except SystemExit as exc:  # argparse or the environment reader refused the value
        return f"{name}={value!r} is refused: {exc.code}"
    if from_env != from_flag:
        return f"{name}={value!r} gives {from_env!r}, but {' '.join(argv)} gives {from_flag!r}"
    return None


@functools.cache
def exposed_metrics() -> dict[str, frozenset[str]]:
    """Sample name -> label names, from a rendered `EngineMetrics` (labelled families that
    stay empty until an event are given one event each)."""
    from prometheus_client.parser import text_string_to_metric_families

    from telemetry.metrics import EngineMetrics

    metrics = EngineMetrics("deploy-check")
    metrics.set_runner("v2", "check", "6")
    metrics.record_rejection("queue_full")
    body, _ = metrics.render()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(names) for name, names in labels.items()}


# ---- PromQL -----------------------------------------------------------------------------

_METRIC_RE = re.compile(r"(?<![\w:])((?:vllm|tandem):[A-Za-z0-9_:]+)")
_SELECTOR_RE = re.compile(r"\{([^}]*)\}")
_MATCHER_RE = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING_RE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND_RE = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


def metric_names(expr: str) -> set[str]:
    return set(_METRIC_RE.findall(_STRING_RE.sub('""', expr)))


def labels_in_expr(expr: str, legend: str = "") -> set[str]:
    """Label names an expression matches on or groups by, and those its legend shows."""
    code = _STRING_RE.sub('""', expr)
    labels = {m for body in _SELECTOR_RE.findall(code) for m in _MATCHER_RE.findall(body)}
    labels |= {
        name.strip()
        for group in _GROUPING_RE.findall(code)
        for name in group.split(",")
        if name.strip()
    }
    return labels | set(_LEGEND_RE.findall(legend))


def dashboard_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(expr, legendFormat) of every panel target, and the template variables' queries."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    exprs = [
        (t["expr"], t.get("legendFormat", ""))
        for p in panels(dashboard["panels"])
        for t in p.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", text)
        if match:
            exprs.append((match[1], "{{" + match[2] + "}}"))
    return exprs


# ---- Dockerfile -------------------------------------------------------------------------


@functools.cache
def _dockerfile() -> tuple[tuple[str, str], ...]:
    instructions, current = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not current and not stripped):
            continue  # comments may sit inside continued instructions too
        if stripped.endswith("\\"):
            current += line.rstrip()[:-1]
            continue
        keyword, _, rest = (current + line).strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        current = ""
    return tuple(instructions)


def dockerfile_instructions(keyword: str) -> list[tuple[str, str]]:
    return [(k, rest) for k, rest in _dockerfile() if k == keyword]


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for _, rest in dockerfile_instructions("ENV"):
        words = shlex.split(rest)
        if "=" not in words[0]:  # legacy `ENV NAME value`
            env[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            name, _, value = word.partition("=")
            env[name] = value
    return env


@dataclass(frozen=True, slots=True)
class HealthCheck:
    options: dict[str, str]
    port: int | None
    path: str


def dockerfile_healthcheck() -> HealthCheck:
    [(_, rest)] = dockerfile_instructions("HEALTHCHECK")
    options_text, _, command = rest.partition(" CMD ")
    options = dict(o.removeprefix("--").split("=", 1) for o in options_text.split())
    env = dockerfile_env()
    command = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m[1], m[0]), command)
    [url] = re.findall(r"https?://[^\s\"']+", command)
    parts = urlsplit(url)
    return HealthCheck(options, parts.port, parts.path)


def duration_s(text: str) -> float:
    """'600s', '1m30s', '45s' (Docker and compose durations) in seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


# ---- Kubernetes ------------------------------------------------------------------------


@functools.cache
def _k8s_documents() -> tuple[dict[str, Any], ...]:
    return tuple(
        doc
        for path in sorted(K8S_DIR.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    )


def k8s_objects(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in _k8s_documents() if doc["kind"] == kind]


def tandem_pod_spec() -> dict[str, Any]:
    [deployment] = k8s_objects("Deployment")
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def container_env(container: dict[str, Any]) -> dict[str, str | None]:
    """name -> value; None where the value comes from a Secret or ConfigMap."""
    return {
        e["name"]: (str(e["value"]) if "value" in e else None) for e in container.get("env", [])
    }


def http_probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        kind: container[kind]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if kind in container
    }


def service_link_env_names(service: dict[str, Any]) -> set[str]:
    """The variables Kubernetes injects into pods for `service` unless enableServiceLinks is
    false (docker-link style: <NAME>_SERVICE_HOST, <NAME>_PORT, ...)."""
    prefix = service["metadata"]["name"].upper().replace("-", "_")
    names = {f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"}
    for port in service["spec"]["ports"]:
        base = f"{prefix}_PORT_{port['port']}_{port.get('protocol', 'TCP')}"
        names |= {base, f"{base}_PROTO", f"{base}_PORT", f"{base}_ADDR"}
        if "name" in port:
            names.add(f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}")
    return names


# ---- compose ----------------------------------------------------------------------------


@functools.cache
def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((COMPOSE_DIR / "docker-compose.yaml").read_text())
    return loaded


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = _compose()["services"]
    return services


def compose_env(service: dict[str, Any]) -> dict[str, str | None]:
    """name -> value; None where compose takes the value from the shell (`${VAR...}`)."""
    raw = service.get("environment", {})
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    return {k: (None if v is None or "${" in str(v) else str(v)) for k, v in raw.items()}
