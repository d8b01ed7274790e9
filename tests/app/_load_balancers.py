"""HAProxy and nginx from Debian's packages, unpacked (not installed) into the checkout's
`.cache/load-balancers/`, and run in the foreground with the configurations shipped in
deploy/: for tests/app/test_load_balancers.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / ".cache" / "load-balancers"
HAPROXY_CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
NGINX_CONFIG = ROOT / "deploy" / "nginx" / "tandem.conf"
_APT_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Unpacked:
    """A program from a Debian package, with the libraries it needs that the system lacks."""

    program: Path
    library_path: str

    def env(self) -> dict[str, str]:
        return {**os.environ, "LD_LIBRARY_PATH": self.library_path}


def unpacked(package: str, program: str) -> Unpacked:
    """`program` (e.g. usr/sbin/haproxy) from `package`, fetched with `apt-get download` and
    unpacked with `dpkg -x` together with the library packages it depends on that dpkg does
    not list as installed. Skips the test where apt-get cannot fetch them."""
    root = CACHE_DIR / package
    if not root.exists():
        if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
            pytest.skip(f"apt-get and dpkg are needed to fetch {package} (a Debian package)")
        # Unpacked aside and renamed into place whole: a run that stops halfway leaves no
        # half cache, and of two runs unpacking at once the first to finish is kept.
        staging = CACHE_DIR / f".{package}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "debs").mkdir(parents=True)
        try:
            _unpack_with_missing_libraries(package, staging)
            os.rename(staging, root)
        except OSError:
            if not root.exists():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    found = Unpacked(root / program, _library_path(root))
    missing = _missing_libraries(found)
    if missing:
        pytest.fail(f"{package}: {program} lacks {missing} although its packages were unpacked")
    return found


def _unpack_with_missing_libraries(package: str, root: Path) -> None:
    wanted, seen = [package], set()
    while wanted:
        name = wanted.pop()
        if name in seen:
            continue
        seen.add(name)
        result = subprocess.run(
            ["apt-get", "download", name],
            cwd=root / "debs",
            capture_output=True,
            text=True,
            timeout=_APT_TIMEOUT_S,
        )
        if result.returncode != 0:
            pytest.skip(f"apt-get download {name} failed: {result.stderr.strip()[-300:]}")
        [deb] = (root / "debs").glob(f"{name}_*.deb")
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True, timeout=60)
        depends = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True, check=True
        ).stdout
        for alternatives in depends.split(","):
            dependency = re.split(r"[\s(:]", alternatives.split("|")[0].strip())[0]
            if dependency.startswith("lib") and not _installed(dependency):
                wanted.append(dependency)


def _installed(package: str) -> bool:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Status}", package], capture_output=True, text=True
    )
    return result.returncode == 0 and result.stdout.endswith(" installed")


def _library_path(root: Path) -> str:
    folders = {str(p.parent) for p in root.glob("usr/lib/**/*.so*")}
    folders |= {str(p.parent) for p in root.glob("lib/**/*.so*")}
    return ":".join(sorted(folders))


def _missing_libraries(found: Unpacked) -> list[str]:
    result = subprocess.run(
        ["ldd", str(found.program)], capture_output=True, text=True, env=found.env(), timeout=10
    )
    return [line.split()[0] for line in result.stdout.splitlines() if "not found" in line]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class BalancerProcess:
    """A load balancer in the foreground on 127.0.0.1:`port`, its stderr in `log_path`."""

    def __init__(self, command: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{command[0]} did not start:\n{log_path.read_text()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_haproxy(haproxy: Unpacked, replicas: list[str], tmp_path: Path) -> BalancerProcess:
    """deploy/haproxy/haproxy.cfg as shipped, its addresses given in its variables."""
    port = free_port()
    env = haproxy.env() | {"TANDEM_LB_BIND": f"127.0.0.1:{port}"}
    env |= {f"TANDEM_REPLICA_{n}": address for n, address in enumerate(replicas, start=1)}
    command = [str(haproxy.program), "-db", "-f", str(HAPROXY_CONFIG)]
    return BalancerProcess(command, env, port, tmp_path / "haproxy.log")


def start_nginx(nginx: Unpacked, replicas: list[str], tmp_path: Path) -> BalancerProcess:
    """deploy/nginx/tandem.conf with its `listen` port and upstream `server` addresses
    replaced, inside the smallest main configuration that runs without root."""
    port = free_port()
    shipped = NGINX_CONFIG.read_text()
    servers = iter(replicas)
    site = re.sub(r"(?m)^(\s*server )[\w.]+:\d+", lambda m: m.group(1) + next(servers), shipped)
    site = re.sub(r"(?m)^(\s*listen )\d+;", rf"\g<1>127.0.0.1:{port};", site)
    if next(servers, None) is not None:
        raise AssertionError("deploy/nginx/tandem.conf has fewer upstream servers than replicas")
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    (prefix / "tandem.conf").write_text(site)
    (prefix / "nginx.conf").write_text(
        "daemon off;\nworker_processes 1;\npid nginx.pid;\nerror_log stderr notice;\n"
        "events {}\nhttp {\n    access_log off;\n"
        + "".join(
            f"    {kind}_temp_path {prefix / kind};\n"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        + f"    include {prefix / 'tandem.conf'};\n}}\n"
    )
    command = [str(nginx.program), "-p", str(prefix), "-e", "stderr", "-c", "nginx.conf"]
    return BalancerProcess(command, nginx.env(), port, tmp_path / "nginx.log")
