"""benchmarks/device_plan.sh, with a stand-in for device_run.sh: each plan runs its steps
with their logs in a folder of its own and leaves one archive in $OUT."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path, device_run: str | None) -> None:
    """device_plan.sh in a tree of its own, with `device_run` as its device_run.sh."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "out").mkdir()
    shutil.copy(ROOT / "benchmarks" / "device_plan.sh", tmp_path / "benchmarks")
    if device_run is not None:
        (tmp_path / "benchmarks" / "device_run.sh").write_text(device_run)


def _plan(tree: Path, *plans: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "benchmarks/device_plan.sh", *plans],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], "OUT": str(tree / "out"), **env},
    )


def test_each_plan_leaves_one_archive_of_its_steps_logs_and_results(tmp_path: Path) -> None:
    # the stand-in records its command line as a result file, as device_run.sh's runs do
    _tree(tmp_path, 'echo "ran $*"; echo "$*" > "$(mktemp -p "$OUT" result-XXXXXX.json)"\n')
    result = _plan(tmp_path, "fp8", "moe")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["fp8.tgz", "moe.tgz"]
    with tarfile.open(tmp_path / "out" / "fp8.tgz") as archive:
        names = sorted(Path(n).name for n in archive.getnames() if n.endswith((".log", ".json")))
        log = archive.extractfile("./w3_fp8_kv.log")
        assert log is not None and b"--kv-cache-dtype fp8" in log.read()
    logs = [n for n in names if n.endswith(".log")]
    assert logs == ["q32_fp8_b1.log", "w3_fp8.log", "w3_fp8_b1.log", "w3_fp8_kv.log"]
    assert len(names) == 2 * len(logs)  # each step's result file came along
    assert "== w5 " in result.stdout


def test_an_unknown_plan_runs_nothing(tmp_path: Path) -> None:
    _tree(tmp_path, None)
    result = _plan(tmp_path, "fp8", "bogus")
    assert result.returncode == 2 and "unknown plan bogus" in result.stderr
    assert list((tmp_path / "out").iterdir()) == []
    usage = _plan(tmp_path)
    assert usage.returncode == 2 and "lane   the GPU lane" in usage.stdout


def test_skip_steps_leaves_out_the_steps_it_names(tmp_path: Path) -> None:
    _tree(tmp_path, 'echo "ran $*"\n')
    result = _plan(tmp_path, "fp8", SKIP_STEPS="w3_fp8")
    assert result.returncode == 0, result.stderr
    assert "== w3_fp8 skipped: in SKIP_STEPS" in result.stdout
    with tarfile.open(tmp_path / "out" / "fp8.tgz") as archive:
        logs = sorted(Path(n).name for n in archive.getnames() if n.endswith(".log"))
    # only the exact name is skipped, not the steps it is a prefix of
    assert logs == ["q32_fp8_b1.log", "w3_fp8_b1.log", "w3_fp8_kv.log"]


def test_plan_end_from_the_caller_holds_the_steps_to_it(tmp_path: Path) -> None:
    _tree(tmp_path, 'echo "ran $*"\n')
    soon = str(int(time.time()) + 10)  # under the 30 s a step needs
    result = _plan(tmp_path, "fp8", PLAN_END=soon, PLAN_BUDGET_S="570")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("s left of PLAN_BUDGET_S") == 4


def test_an_a_b_run_gives_each_step_twice_its_time(tmp_path: Path) -> None:
    _tree(tmp_path, 'echo "ran $*"\n')
    alone = _plan(tmp_path, "fp8", SKIP_STEPS="q32_fp8_b1 w3_fp8 w3_fp8_kv")
    both = _plan(tmp_path, "fp8", SKIP_STEPS="q32_fp8_b1 w3_fp8 w3_fp8_kv", BASELINE="base")
    assert "== w3_fp8_b1 (" in alone.stdout and "limit 80 s)" in alone.stdout
    assert "limit 160 s)" in both.stdout


def test_kernel_profile_0_drops_the_profile_runs(tmp_path: Path) -> None:
    _tree(tmp_path, 'echo "ran $*"\n')
    skip = "q32_fp8_b1 w3_fp8 w3_fp8_kv"
    profiled = _plan(tmp_path, "fp8", SKIP_STEPS=skip)
    with tarfile.open(tmp_path / "out" / "fp8.tgz") as archive:
        log = archive.extractfile("./w3_fp8_b1.log")
        assert log is not None and b"--kernel-profile" in log.read()
    plain = _plan(tmp_path, "fp8", SKIP_STEPS=skip, KERNEL_PROFILE="0")
    assert profiled.returncode == plain.returncode == 0, plain.stderr
    with tarfile.open(tmp_path / "out" / "fp8.tgz") as archive:
        log = archive.extractfile("./w3_fp8_b1.log")
        assert log is not None
        text = log.read()
    assert b"--kernel-profile" not in text and b"--quantization fp8" in text
