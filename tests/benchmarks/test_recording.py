"""Recording a result: only from a committed tree (by git, or by the stamp a tree carries to
a machine without git), one file per result holding the current entry and its history,
and the GPU machine's run script that records into $OUT."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import recording

ROOT = Path(__file__).resolve().parents[2]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A committed checkout with a package file and a result file."""
    repo = tmp_path / "repo"
    (repo / "actors").mkdir(parents=True)
    (repo / "actors" / "engine.py").write_text("STEP = 1\n")
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "w1.json").write_text("{}\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return repo


def _args(tmp_path: Path, *extra: str) -> object:
    return recording.parser("throughput", None).parse_args(
        ["--results-dir", str(tmp_path / "out"), *extra]
    )


def test_a_clean_checkout_names_its_commit_and_results_do_not_dirty_it(repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    assert recording.source_state(repo) == recording.Source(head, True, "git")
    (repo / "benchmarks" / "results" / "w1.json").write_text('{"current": 1}\n')
    (repo / "benchmarks" / "results" / "new.json").write_text("{}\n")
    assert recording.source_state(repo).clean
    (repo / "actors" / "engine.py").write_text("STEP = 2\n")
    state = recording.source_state(repo)
    assert not state.clean and "actors/engine.py" in state.how
    (repo / "actors" / "engine.py").write_text("STEP = 1\n")
    (repo / "actors" / "new.py").write_text("\n")
    assert not recording.source_state(repo).clean  # an untracked file is a change too


def test_a_run_from_an_unclean_tree_stops_unless_it_is_not_a_result(
    repo: Path, tmp_path: Path
) -> None:
    (repo / "actors" / "engine.py").write_text("STEP = 2\n")
    with pytest.raises(recording.DirtyTreeError, match="--not-a-result"):
        recording.Run("throughput", _args(tmp_path), "w1", {}, [], roots=(repo, repo))
    run = recording.Run(
        "throughput", _args(tmp_path, "--not-a-result"), "w1", {"n": 1}, [], roots=(repo, repo)
    )
    record = run.finish({"tok_s": 1.0}, {"runs": []})
    assert record["clean"] is False and record["commit"] == _git(repo, "rev-parse", "HEAD")
    assert not (tmp_path / "out").exists()  # nothing recorded


def test_each_result_keeps_its_current_entry_and_a_history(repo: Path, tmp_path: Path) -> None:
    for rate in (10.0, 20.0, 30.0):
        run = recording.Run(
            "throughput",
            _args(tmp_path),
            "w1",
            {"name": "W1"},
            ["--workload", "W1"],
            roots=(repo, repo),
        )
        run.finish({"tok_s": rate}, {"runs": [rate]})
    result = json.loads((tmp_path / "out" / "w1.json").read_text())
    assert result["result"] == "w1" and result["benchmark"] == "throughput"
    current = result["current"]
    assert current["figures"] == {"tok_s": 30.0} and current["details"] == {"runs": [30.0]}
    assert current["commit"] == _git(repo, "rev-parse", "HEAD") and current["clean"] is True
    assert current["command"] == "python -m benchmarks.throughput --workload W1"
    assert current["workload"] == {"name": "W1"} and current["date"].endswith("Z")
    assert {"cpu", "num_cpus", "gpus", "python", "torch"} <= set(current["hardware"])
    assert [e["figures"]["tok_s"] for e in result["history"]] == [10.0, 20.0]
    assert all("details" not in e for e in result["history"])


def test_a_stamp_carries_the_commit_to_a_tree_without_git(repo: Path, tmp_path: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    stamp = recording.write_stamp(repo)
    copy = tmp_path / "device"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    assert recording.source_state(copy) == recording.Source(head, True, "stamp")
    (copy / "actors" / "engine.py").write_text("STEP = 2\n")
    assert not recording.source_state(copy).clean
    (copy / "actors" / "engine.py").write_text("STEP = 1\n")
    (copy / "actors" / "extra.py").write_text("\n")
    assert "actors/extra.py" in recording.source_state(copy).how
    stamp.unlink()
    (repo / "actors" / "engine.py").write_text("STEP = 2\n")
    with pytest.raises(recording.DirtyTreeError):
        recording.write_stamp(repo)


def test_a_stamp_wins_over_the_git_metadata_of_another_commit(repo: Path, tmp_path: Path) -> None:
    # The GPU machine's copy of the tree may hold a .git whose HEAD is not the tree's.
    head = _git(repo, "rev-parse", "HEAD")
    recording.write_stamp(repo)
    copy = tmp_path / "device"
    shutil.copytree(repo, copy)
    (copy / "actors" / "engine.py").write_text("STEP = 9\n")
    _git(copy, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "other")
    (copy / "actors" / "engine.py").write_text("STEP = 1\n")  # the stamped tree, uncommitted
    assert recording.source_state(copy) == recording.Source(head, True, "stamp")


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs this checkout's git history")
def test_a_baseline_extracted_from_a_commit_is_stamped_from_this_repository(tmp_path: Path) -> None:
    """The A/B baseline of device_run.sh: `git archive REV | tar -x -C .base`."""
    base = tmp_path / "base"
    base.mkdir()
    archive = subprocess.run(
        ["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    stamp = json.loads(recording.write_stamp(base, "HEAD").read_text())
    assert stamp["commit"] == _git(ROOT, "rev-parse", "HEAD")
    (base / "README.md").write_text("changed\n")
    with pytest.raises(recording.DirtyTreeError, match="differs from its stamp: README.md"):
        recording.write_stamp(base, "HEAD")


def test_device_run_records_into_out_and_runs_an_ab_in_turns(tmp_path: Path) -> None:
    def device_run(*command: str, **env: str) -> list[str]:
        result = subprocess.run(
            ["bash", str(ROOT / "benchmarks" / "device_run.sh"), *command],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={
                "PATH": "/usr/bin:/bin",
                "OUT": str(tmp_path),
                "WHEELS": str(tmp_path / "no-wheels"),
                **env,
            },
        )
        return [line for line in result.stdout.splitlines() if not line.startswith("===")]

    assert device_run("echo", "run") == [f"run --results-dir {tmp_path}"]
    assert (tmp_path / "device.txt").is_file()
    base = tmp_path / "base_tree"
    base.mkdir()
    lines = device_run("echo", "run", BASELINE=str(base), ROUNDS="2")
    assert lines == [
        f"-P run --results-dir {tmp_path}/base",
        f"run --results-dir {tmp_path}",
        f"run --results-dir {tmp_path}",
        f"-P run --results-dir {tmp_path}/base",
    ]
