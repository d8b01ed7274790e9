"""What every benchmark of the suite shares: its command line's common options, and the
recording of its result.

A result is recorded only from a committed tree, and names its commit: a run from a tree
with uncommitted changes stops before it starts, unless `--not-a-result` says it is a trial
(its record then goes to `--output` or the screen, never into the results). Each result
name has one file, `benchmarks/results/<name>.json`:

    {"result": NAME, "benchmark": ..., "current": ENTRY, "history": [ENTRY, ...]}

An entry holds `date`, `commit`, `clean`, `hardware`, `command`, `workload`, `figures`
(the headline numbers `python -m benchmarks.report` compares) and, for `current` only,
`details` (everything the run measured). A new result becomes `current`; the one before
moves to the end of `history` without its details.

The GPU machine has the tree without its git metadata, so the commit travels as a stamp:
from a committed tree, `python -m benchmarks.recording stamp` writes `.bench_stamp.json`
(the commit and every tracked file's git blob hash); carried with the tree, it lets a run
there name the commit and check, file by file, that the tree is that commit's.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the benchmarks come from (and their results live in)."""
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
STAMP_NAME = ".bench_stamp.json"
NOT_SOURCE = ("benchmarks/results/", STAMP_NAME)
"""Paths that never make a tree dirty: the results a run writes, and the stamp itself."""
PACKAGES = ("app", "actors", "gpu", "kernels", "telemetry", "benchmarks")


class DirtyTreeError(SystemExit):
    """The tree is not a commit's: no result can name what ran (ends the run with this
    message)."""


@dataclass(frozen=True, slots=True)
class Source:
    commit: str | None
    clean: bool
    how: str
    """How the commit is known ('git', 'stamp'), or what makes the tree unclean."""


def product_root() -> Path:
    """The checkout whose engine runs: where `actors` is imported from. The same as
    REPO_ROOT, except in an A/B run of device_run.sh, which runs these benchmarks on a
    baseline checkout's engine."""
    spec = importlib.util.find_spec("actors")
    if spec is None or spec.origin is None:
        return REPO_ROOT
    return Path(spec.origin).resolve().parents[1]


def source_state(root: Path = REPO_ROOT) -> Source:
    """The commit of the tree at `root` and whether the tree is exactly that commit. A stamp
    wins over git metadata: it is written on purpose for a copy of the tree (the GPU
    machine's copy may hold a .git of some other commit), and it is checked file by file."""
    if (root / STAMP_NAME).is_file():
        return _check_stamp(root, json.loads((root / STAMP_NAME).read_text()))
    return _git_state(root)


def _git_state(root: Path) -> Source:
    head = _git(root, "rev-parse", "HEAD")
    if head is not None and Path(_git(root, "rev-parse", "--show-toplevel") or "") == root:
        status = _git(root, "status", "--porcelain", "--untracked-files=normal") or ""
        changed = [line[3:] for line in status.splitlines() if not line[3:].startswith(NOT_SOURCE)]
        if changed:
            return Source(
                head,
                False,
                f"uncommitted changes: {', '.join(changed[:5])}"
                + (f" and {len(changed) - 5} more" if len(changed) > 5 else ""),
            )
        return Source(head, True, "git")
    return Source(None, False, f"no git metadata and no {STAMP_NAME} (benchmarks/recording.py)")


def write_stamp(root: Path = REPO_ROOT, commit: str | None = None) -> Path:
    """Write `root`/.bench_stamp.json for a run on a machine without git. `root` is a clean
    git checkout, or (with `commit`) a tree extracted from that commit of this repository
    (`git archive COMMIT | tar -x -C DIR`); either way the files must match the commit."""
    if commit is None:
        source = _git_state(root)
        if not source.clean or source.how != "git":
            raise DirtyTreeError(f"{root}: {source.how}")
        commit, repo = source.commit, root
    else:
        repo, named = REPO_ROOT, commit
        commit = _git(repo, "rev-parse", f"{named}^{{commit}}")
        if commit is None:
            raise DirtyTreeError(f"no commit {named!r} in {repo}")
    assert commit is not None
    blobs = {}
    for line in (_git(repo, "ls-tree", "-r", commit) or "").splitlines():
        meta, name = line.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob" and mode != "120000" and not name.startswith(NOT_SOURCE):
            blobs[name] = sha
    stamp = {"commit": commit, "blobs": blobs}
    checked = _check_stamp(root, stamp)
    if not checked.clean:
        raise DirtyTreeError(f"{root}: {checked.how}")
    path = root / STAMP_NAME
    path.write_text(json.dumps(stamp, indent=0) + "\n")
    return path


def _check_stamp(root: Path, stamp: dict[str, Any]) -> Source:
    blobs: dict[str, str] = stamp["blobs"]
    changed = [path for path, sha in blobs.items() if _blob_sha(root / path) != sha]
    added = [
        str(p.relative_to(root))
        for package in PACKAGES
        for p in sorted((root / package).rglob("*.py"))
        if str(p.relative_to(root)) not in blobs and "__pycache__" not in p.parts
    ]
    if changed or added:
        return Source(
            stamp["commit"],
            False,
            f"the tree differs from its stamp: {', '.join((changed + added)[:5])}",
        )
    return Source(stamp["commit"], True, "stamp")


def _blob_sha(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True
        ).stdout.rstrip("\n")
    except (OSError, subprocess.SubprocessError):
        return None


def hardware() -> dict[str, Any]:
    """CPU, GPUs (from nvidia-smi: no torch import) and the versions that decide speed."""
    gpus: list[str] = []
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        pass
    versions: dict[str, str | None] = {}
    for package in ("torch", "triton", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "gpus": [g.strip() for g in gpus if g.strip()],
        "python": platform.python_version(),
        **versions,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (the benchmark machines are shared)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def parser(benchmark: str, doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser with the options every benchmark takes."""
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{benchmark}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = p.add_argument_group("recording")
    group.add_argument(
        "--result",
        metavar="NAME",
        help="the result this run records (default: the benchmark's own)",
    )
    group.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="where result files are read and written (default %(default)s; "
        "on the GPU machine $OUT)",
    )
    group.add_argument(
        "--not-a-result",
        action="store_true",
        help="a trial: runs from a tree with uncommitted changes, records nothing in the results",
    )
    group.add_argument(
        "--output", type=Path, help="also write this run's whole record here (rewritten as it runs)"
    )
    return p


class Run:
    """One run of a benchmark: the tree is checked when it starts (a run that cannot be a
    result stops at once, not after an hour), the result recorded when it ends."""

    def __init__(
        self,
        benchmark: str,
        args: argparse.Namespace,
        default_result: str,
        workload: dict[str, Any],
        argv: list[str] | None = None,
        roots: tuple[Path, Path] | None = None,
    ) -> None:
        """`roots`: the checkouts of the engine and of the benchmarks (default:
        product_root() and REPO_ROOT)."""
        self.benchmark = benchmark
        self.result = args.result or default_result
        self.results_dir: Path = args.results_dir
        self.output: Path | None = args.output
        self.is_result = not args.not_a_result
        product, harness = roots or (product_root(), REPO_ROOT)
        sources = {"commit": (product, source_state(product))}
        if harness != product:
            sources["benchmarks_commit"] = (harness, source_state(harness))
        unclean = [f"{root}: {s.how}" for root, s in sources.values() if not s.clean]
        if self.is_result and unclean:
            raise DirtyTreeError(
                f"{'; '.join(unclean)}: a result must name the commit that "
                "ran. Commit first, or pass --not-a-result for a trial."
            )
        argv = sys.argv[1:] if argv is None else argv
        self.entry: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **{key: s.commit for key, (_, s) in sources.items()},
            "clean": not unclean,
            "hardware": hardware(),
            "command": shlex.join(["python", "-m", f"benchmarks.{benchmark}", *argv]),
            "workload": workload,
            "load_average_before": load_average(),
        }

    def checkpoint(self, details: dict[str, Any]) -> None:
        """Write what the run has measured so far to --output (an interrupted run keeps it)."""
        if self.output is not None:
            _write(self.output, {**self.entry, "details": details})

    def finish(self, figures: dict[str, Any], details: dict[str, Any]) -> dict[str, Any]:
        """The whole record; as the result's new current entry unless --not-a-result."""
        record = {
            **self.entry,
            "load_average_after": load_average(),
            "figures": figures,
            "details": details,
        }
        if self.output is not None:
            _write(self.output, record)
        if self.is_result:
            path = record_result(self.results_dir, self.result, self.benchmark, record)
            print(f"recorded {path}", file=sys.stderr)
        elif self.output is None:
            print(json.dumps({k: record[k] for k in ("commit", "clean", "figures")}, indent=1))
        return record


def record_result(results_dir: Path, result: str, benchmark: str, entry: dict[str, Any]) -> Path:
    """Make `entry` the result's current one, the one before it the last of its history.
    The history is read from `results_dir` if the result is there, else from the
    repository's results (a run on the GPU machine writes to $OUT)."""
    path = results_dir / f"{result}.json"
    existing = (
        load_result(path)
        or load_result(RESULTS_DIR / f"{result}.json")
        or {"result": result, "benchmark": benchmark, "current": None, "history": []}
    )
    previous = existing["current"]
    history = list(existing["history"])
    if previous is not None:
        history.append({k: v for k, v in previous.items() if k != "details"})
    _write(path, {"result": result, "benchmark": benchmark, "current": entry, "history": history})
    return path


def load_result(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _write(path: Path, value: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1, default=str) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.recording",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    stamp = sub.add_parser("stamp", help=f"write {STAMP_NAME} for a run without git")
    stamp.add_argument(
        "--tree", type=Path, default=REPO_ROOT, help="the checkout to stamp (default: this one)"
    )
    stamp.add_argument("--commit", help="the tree is `git archive COMMIT` of this repository")
    sub.add_parser("check", help="print the commit and whether the tree can record a result")
    args = p.parse_args(argv)
    if args.command == "stamp":
        try:
            print(f"wrote {write_stamp(args.tree.resolve(), args.commit)}")
        except DirtyTreeError as exc:
            print(f"not stamped: {exc}", file=sys.stderr)
            return 1
        return 0
    source = source_state(product_root())
    print(json.dumps({"commit": source.commit, "clean": source.clean, "how": source.how}))
    return 0 if source.clean else 1


if __name__ == "__main__":
    sys.exit(main())
