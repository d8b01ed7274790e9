"""The GPU lane's bookkeeping (.ci/gpu-lane), on CPU: what a pytest run's events count as,
how a record joins .ci/gpu-lane.json, how the tree that ran is told apart from its commit,
and that every gpu-marked test lies where the lane looks."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_lane() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gpu_lane", str(REPO_ROOT / ".ci" / "gpu-lane"))
    spec = importlib.util.spec_from_loader("gpu_lane", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


lane = _load_lane()

SAMPLE_TESTS = """
import pytest

@pytest.fixture
def broken_setup():
    raise RuntimeError("setup broke")

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

def test_errors_in_setup(broken_setup):
    pass

def test_passes_then_errors_in_teardown(broken_teardown):
    pass

@pytest.mark.skipif(True, reason="no such device")
def test_skipped_by_a_mark():
    pass

@pytest.mark.skipif(True, reason="no such device")
def test_skipped_by_the_same_mark():
    pass

def test_skips_itself():
    pytest.skip("not today")

@pytest.mark.xfail(reason="known")
def test_expected_to_fail():
    assert False

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1

@pytest.mark.other
def test_deselected():
    pass
"""


def _run_sample(tmp_path: Path) -> tuple[list[dict[str, Any]], int]:
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    (tmp_path / "test_broken_import.py").write_text("import no_such_module_here\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    other: deselected\n")
    events = tmp_path / "events.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / ".ci" / "gpu-lane"),
            "_pytest",
            str(events),
            "--",
            "-m",
            "not other",
            "--continue-on-collection-errors",
            "-p",
            "no:cacheprovider",
            "-q",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return lane.read_events(events), result.returncode


def test_a_pytest_run_counts_as_pytest_counts_it(tmp_path: Path) -> None:
    events, exit_status = _run_sample(tmp_path)
    summary = lane.summarize(events)
    assert exit_status == 1
    assert summary["counts"] == {
        "passed": 3,
        "failed": 2,
        "skipped": 3,
        "error": 3,
        "xfailed": 1,
        "xpassed": 0,
    }
    assert summary["collected"] == 10 and summary["deselected"] == 1
    assert summary["failures"] == ["test_sample.py::test_fails", "test_sample.py::test_param[2]"]
    assert sorted(summary["errors"]) == [
        "test_broken_import.py",
        "test_sample.py::test_errors_in_setup",
        "test_sample.py::test_passes_then_errors_in_teardown",
    ]
    assert summary["skips"] == [
        {"reason": "no such device", "count": 2},
        {"reason": "not today", "count": 1},
    ]
    assert "one is not two" in summary["messages"]["test_sample.py::test_fails"]
    assert "setup broke" in summary["messages"]["test_sample.py::test_errors_in_setup"]
    assert "no_such_module_here" in summary["messages"]["test_broken_import.py"]


def test_a_test_that_never_finished_is_an_error_when_time_ran_out() -> None:
    def report(nodeid: str, when: str) -> dict[str, Any]:
        return {"event": "report", "nodeid": nodeid, "when": when, "outcome": "passed"}

    events = [
        {"event": "collected", "count": 2},
        {"event": "start", "nodeid": "t.py::test_a"},
        report("t.py::test_a", "setup"),
        report("t.py::test_a", "call"),
        report("t.py::test_a", "teardown"),
        {"event": "start", "nodeid": "t.py::test_hangs"},
        report("t.py::test_hangs", "setup"),
    ]
    assert lane.summarize(events)["errors"] == []
    summary = lane.summarize(events, timed_out=True)
    assert summary["errors"] == ["t.py::test_hangs"]
    assert summary["counts"]["passed"] == 1 and summary["counts"]["error"] == 1
    assert "time ran out" in summary["messages"]["t.py::test_hangs"]


def _record(
    tmp_path: Path,
    *,
    dirty: bool = False,
    events: list[dict[str, Any]] | None = None,
    exit_status: int | None = 0,
    timed_out: bool = False,
) -> dict[str, Any]:
    events = (
        events
        if events is not None
        else [{"event": "report", "nodeid": "t.py::test_a", "when": "call", "outcome": "passed"}]
    )
    source = {
        "commit": "a" * 40,
        "dirty": dirty,
        "modified": ["gpu/x.py"] if dirty else [],
        "missing": [],
        "untracked": [],
        "num_changed": int(dirty),
    }
    return lane.build_record(
        events,
        source=source,
        wheels=[],
        hardware={"gpu": "NVIDIA H200", "driver": "580"},
        command="python3 -m pytest -m gpu",
        duration_s=1.0,
        exit_status=exit_status,
        timed_out=timed_out,
    )


def test_green_needs_a_passing_test_and_nothing_red(tmp_path: Path) -> None:
    assert _record(tmp_path)["green"]
    assert not _record(tmp_path, events=[])["green"]  # everything skipped proves nothing
    assert not _record(tmp_path, exit_status=1)["green"]
    assert not _record(tmp_path, exit_status=None, timed_out=True)["green"]
    failed = [
        {
            "event": "report",
            "nodeid": "t.py::test_b",
            "when": "call",
            "outcome": "failed",
            "message": "AssertionError",
        }
    ]
    red = _record(tmp_path, events=failed, exit_status=1)
    assert not red["green"]
    assert "FAILED t.py::test_b - AssertionError" in lane.render_summary(red)


def test_merge_makes_the_record_current_and_keeps_the_last_one_in_history(tmp_path: Path) -> None:
    first, second = _record(tmp_path), _record(tmp_path)
    merged = lane.merge_record(None, first)
    assert merged == {"current": first, "history": []}
    merged = lane.merge_record(json.loads(json.dumps(merged)), second)
    assert merged["current"] == second
    assert merged["history"] == [lane.compact(first)]
    assert merged["history"][0]["commit"] == "a" * 40 and merged["history"][0]["green"]
    with pytest.raises(lane.LaneError, match="already"):
        lane.merge_record(merged, second)


def test_merge_refuses_a_dirty_tree_unless_told(tmp_path: Path) -> None:
    dirty = _record(tmp_path, dirty=True)
    with pytest.raises(lane.LaneError, match="differs from aaaaaaaaaaaa in 1 files"):
        lane.merge_record(None, dirty)
    assert lane.merge_record(None, dirty, allow_dirty=True)["current"]["source"]["dirty"]
    no_commit = _record(tmp_path)
    no_commit["source"] = lane.check_source(tmp_path, None)
    with pytest.raises(lane.LaneError, match="names no commit"):
        lane.merge_record(None, no_commit, allow_dirty=True)


def test_merge_command_writes_the_lane_file(tmp_path: Path) -> None:
    record_file, lane_file = tmp_path / "gpu-lane.json", tmp_path / "lane.json"
    for _ in range(2):
        record_file.write_text(json.dumps(_record(tmp_path)))
        assert lane.main(["merge", str(record_file), "--lane-file", str(lane_file)]) == 0
    written = json.loads(lane_file.read_text())
    assert len(written["history"]) == 1 and written["current"]["green"]
    record_file.write_text(json.dumps(_record(tmp_path, dirty=True)))
    assert lane.main(["merge", str(record_file), "--lane-file", str(lane_file)]) == 2
    assert json.loads(lane_file.read_text()) == written


def test_the_committed_lane_file_is_a_lane_file() -> None:
    written = json.loads((REPO_ROOT / ".ci" / "gpu-lane.json").read_text())
    assert set(written) == {"current", "history"}
    if written["current"] is not None:
        assert written["current"]["lane"] == "gpu" and written["current"]["source"]["commit"]


def test_the_tree_is_told_apart_from_the_commit_it_was_stamped_with(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "same.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "changed.py").write_text("y = 2\n")
    (tmp_path / "pkg" / "new.py").write_text("z = 3\n")
    (tmp_path / "pkg" / "cache.pyc").write_bytes(b"\0")
    (tmp_path / ".gitignore").write_text("*.pyc\n/.gpu-lane/\n")
    stamp = {
        "commit": "c" * 40,
        "blobs": {
            "pkg/same.py": lane.blob_id(b"x = 1\n"),
            "pkg/changed.py": lane.blob_id(b"y = 1\n"),
            "pkg/gone.py": lane.blob_id(b""),
            ".gitignore": lane.blob_id(b"*.pyc\n/.gpu-lane/\n"),
        },
    }
    source = lane.check_source(tmp_path, stamp)
    assert source["dirty"] and source["commit"] == "c" * 40
    assert (source["modified"], source["missing"], source["untracked"]) == (
        ["pkg/changed.py"],
        ["pkg/gone.py"],
        ["pkg/new.py"],
    )
    (tmp_path / "pkg" / "changed.py").write_text("y = 1\n")
    (tmp_path / "pkg" / "gone.py").write_text("")
    (tmp_path / "pkg" / "new.py").unlink()
    assert lane.check_source(tmp_path, stamp)["dirty"] is False


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_blob_ids_are_gits() -> None:
    data = b"tandem\n\x00binary"
    git = subprocess.run(
        ["git", "hash-object", "--stdin"],
        input=data,
        capture_output=True,
        check=True,
        cwd=REPO_ROOT,
    )
    assert lane.blob_id(data) == git.stdout.decode().strip()


GPU_MARKS = re.compile(r"pytest\.mark\.gpu|\bcuda_test\b|\btriton_vs_reference_tests\b")


def test_every_gpu_marked_test_is_where_the_lane_runs() -> None:
    """The lane runs `-m gpu` over LANE_PATHS only (elsewhere it lacks the test-only
    dependencies); a gpu-marked test anywhere else would never run."""
    outside = []
    for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
        relative = path.relative_to(REPO_ROOT).as_posix()
        if path == Path(__file__).resolve() or relative.startswith(tuple(lane.LANE_PATHS)):
            continue
        if GPU_MARKS.search(path.read_text(encoding="utf-8")):
            outside.append(relative)
    assert outside == []


def test_every_runtime_dependency_reaches_the_gpu_machine() -> None:
    """A dependency neither in the GPU image nor carried as a wheel fails every test that
    imports it there (as openai-harmony once did)."""
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    names = {
        re.split(r"[<>=;!~ \[]", requirement, maxsplit=1)[0].strip().lower()
        for requirement in project["dependencies"]
    }
    reach = {*lane.IMAGE_PACKAGES, *lane.WHEELS}
    assert sorted(names - reach) == []


def test_parts_at_once_installs_once_and_runs_every_part_beside_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installs: list[bool] = []
    started: list[tuple[list[str], str]] = []

    class FakeChild:
        def __init__(self, command: list[str], env: dict[str, str], **_: Any) -> None:
            started.append((command, env["OUT"]))
            self.status = 1 if "--part=2/3" in command else 0
            Path(env["OUT"], "run.out").write_text(f"summary of {command[3]}\n")

        def wait(self) -> int:
            assert len(started) == 3, "a part was waited for before every part had started"
            return self.status

    monkeypatch.setattr(lane, "install_wheels", lambda: installs.append(True) or [])
    monkeypatch.setattr(lane.subprocess, "Popen", FakeChild)
    monkeypatch.setenv("OUT", str(tmp_path))
    status = lane.main(["run", "--parts-at-once", "3", "--budget", "500", "--", "-k", "fp8"])
    assert status == 1 and installs == [True]  # one part red: the call is red
    assert [out for _, out in started] == [str(tmp_path / f"part-{k}") for k in (1, 2, 3)]
    for index, (command, _) in enumerate(started, start=1):
        assert command[2:4] == ["run", f"--part={index}/3"]
        assert "--installed" in command and command[-3:] == ["--", "-k", "fp8"]
    assert lane.main(["run", "--parts-at-once", "2", "--part", "1/2"]) == 2
