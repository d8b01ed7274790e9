"""deploy/image/ (build.sh, smoke.sh) and the Dockerfile facts they and deploy/README.md rely
on, checked without a container engine: the scripts parse, document every option they take
and build the command they should; the CPU image gets no compiler; nothing the image needs
is left out of it."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.app._deploy_files import dockerfile_instructions

ROOT = Path(__file__).resolve().parents[2]
IMAGE_DIR = ROOT / "deploy" / "image"
SCRIPTS = ("build.sh", "smoke.sh", "engine.sh")
PRODUCT_PACKAGES = ("app", "actors", "gpu", "kernels", "telemetry")
COMPILERS = {"gcc", "g++", "cc", "clang", "build-essential", "python3-dev", "libc6-dev"}
TRITON_GUARD = re.compile(r"^if python -c \"[^\"]*find_spec\('triton'\) is None\)\"; then")


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        ["bash", str(IMAGE_DIR / script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _dry_run(tmp_path: Path, *args: str, engine: str = "podman") -> list[str]:
    """The build command build.sh would run (its last line), split into words."""
    cert = tmp_path / "ca.pem"
    cert.write_text("not a real bundle\n")
    out = _run(
        "build.sh",
        "--dry-run",
        *args,
        env={
            "IMAGE_ENGINE": engine,
            "IMAGE_OCI_RUNTIME": "runc",
            "IMAGE_ULIMITS": "nofile=1024:1024",
            "PIP_CERT": str(cert),
        },
    )
    return shlex.split(out.strip().splitlines()[-1])


def _build_args(words: list[str]) -> dict[str, str]:
    return dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg")


def _dockerfile_args() -> dict[str, str]:
    return {
        rest.split("=", 1)[0]: rest.partition("=")[2] for _, rest in dockerfile_instructions("ARG")
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(IMAGE_DIR / script)], check=True)


@pytest.mark.parametrize("script", ["build.sh", "smoke.sh"])
def test_help_documents_every_option_and_variable(script: str) -> None:
    help_text = _run(script, "--help")
    source = (IMAGE_DIR / script).read_text()
    options = set(re.findall(r"^\s*(--[a-z-]+)(?: \| -\w)?\)", source, re.M))
    options |= set(re.findall(r"^\s*-\w \| (--[a-z-]+)\)", source, re.M))
    # what a user may set: the scripts' own variables, the build's inputs, pip's
    read = r"\$\{((?:IMAGE|SMOKE|TORCH|DEBIAN|PIP)_[A-Z_]+|BASE_IMAGE)\b"
    variables = set(re.findall(read, source))
    variables |= set(re.findall(read, (IMAGE_DIR / "engine.sh").read_text()))
    assert "--help" in options
    undocumented = {o for o in options | variables if o not in help_text}
    assert not undocumented, f"{script} --help does not mention {sorted(undocumented)}"


def test_smoke_needs_an_image() -> None:
    done = subprocess.run(["bash", str(IMAGE_DIR / "smoke.sh")], capture_output=True, text=True)
    assert done.returncode == 2 and "Usage:" in done.stderr


def test_cpu_build_command(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    words = _dry_run(tmp_path, "--cpu", "--wheels", str(wheels))
    assert words[:4] == ["podman", "--runtime", "runc", "build"]
    # podman's default OCI format has no HEALTHCHECK: it would be dropped
    assert words[words.index("--format") + 1] == "docker"
    assert words[words.index("--ulimit") + 1] == "nofile=1024:1024"
    assert words[words.index("--secret") + 1].startswith("id=pip_cert,src=")
    # the wheels are served on the host's 127.0.0.1, which only its network reaches
    assert words[words.index("--network") + 1] == "host"
    args = _build_args(words)
    assert args["TORCH_VERSION"] == _dockerfile_args()["TORCH_VERSION"] + "+cpu"
    assert args["TORCH_FIND_LINKS"].startswith("http://127.0.0.1:")
    assert args["BASE_IMAGE"] == "debian:bookworm-slim"
    assert set(args) <= set(_dockerfile_args()), "build.sh passes args the Dockerfile lacks"
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version and words[words.index("--tag") + 1] == f"tandem:{version[1]}-cpu"
    assert words[-1] == str(ROOT)


def test_gpu_build_command_keeps_the_dockerfile_defaults(tmp_path: Path) -> None:
    words = _dry_run(tmp_path, engine="docker")
    assert words[:2] == ["docker", "build"]
    assert "--format" not in words and "--runtime" not in words  # not docker build options
    assert {"BASE_IMAGE", "TORCH_VERSION", "TORCH_INDEX_URL"}.isdisjoint(_build_args(words))


def test_debootstrap_base(tmp_path: Path) -> None:
    cert = tmp_path / "ca.pem"
    cert.write_text("")
    out = _run(
        "build.sh",
        "--dry-run",
        "--cpu",
        "--debootstrap",
        "--wheels",
        str(tmp_path),
        env={"IMAGE_ENGINE": "podman", "IMAGE_ULIMITS": "", "PIP_CERT": str(cert)},
    )
    assert re.search(r"^debootstrap --variant=minbase bookworm ", out, re.M)
    assert re.search(r"\| podman( --runtime \S+)? import .* - tandem-base:bookworm$", out, re.M)
    words = shlex.split(out.strip().splitlines()[-1])
    assert _build_args(words)["BASE_IMAGE"] == "tandem-base:bookworm"
    assert "--ulimit" not in words


def test_the_cpu_image_gets_no_compiler() -> None:
    """Only Triton needs a compiler (its C launcher), and the CPU torch wheel brings no
    Triton: a RUN that installs packages names a compiler only behind that check."""
    installs = [run for _, run in dockerfile_instructions("RUN") if "apt-get install" in run]
    assert len(installs) >= 2
    for run in installs:
        # every word counts: package lists are also built in shell variables
        compilers = set(re.findall(r"[\w+.-]+", run)) & COMPILERS
        assert TRITON_GUARD.match(run) or not compilers, f"{compilers} always installed: {run}"
    guarded = [run for run in installs if TRITON_GUARD.match(run)]
    assert guarded and {"gcc", "python3-dev"} <= set(re.findall(r"[\w+.-]+", guarded[0]))


def test_the_image_has_what_its_entrypoint_and_healthcheck_run() -> None:
    [(_, base_install)] = [
        (k, run) for k, run in dockerfile_instructions("RUN") if "tini" in run and "curl" in run
    ]
    assert not TRITON_GUARD.match(base_install)
    [(_, entrypoint)] = dockerfile_instructions("ENTRYPOINT")
    assert entrypoint.startswith('["/usr/bin/tini"')
    [(_, check)] = dockerfile_instructions("HEALTHCHECK")
    assert " CMD curl " in check
    # a fixed numeric uid (Kubernetes' runAsNonRoot), the one smoke.sh checks processes for
    [(_, user)] = dockerfile_instructions("USER")
    assert user == "10001:10001"
    runs = " ".join(run for _, run in dockerfile_instructions("RUN"))
    assert re.search(r"useradd .*--uid 10001 --gid 10001 ", runs)
    assert f"$user == {user} ]]" in (IMAGE_DIR / "smoke.sh").read_text()


def test_every_pip_install_sees_the_build_secret() -> None:
    for _, run in dockerfile_instructions("RUN"):
        if "pip install" in run:
            assert run.startswith("--mount=type=secret,id=pip_cert "), run[:120]
    assert "id=pip_cert," in (IMAGE_DIR / "build.sh").read_text()


def test_the_image_leaves_out_only_what_the_product_never_imports() -> None:
    copied = {rest.split()[0] for _, rest in dockerfile_instructions("COPY")}
    assert "benchmarks" not in copied
    imported = set()
    for package in PRODUCT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    local = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    missing = (imported & local) - copied
    assert not missing, f"the product imports {missing}, which the image does not copy"
