"""The GPU lane in parts (.ci/gpu_lane_parts.py): the deal of test files, the parts of a
real pytest run covering each test once, and the joining of the parts' records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ci.test_gpu_lane import REPO_ROOT, lane

parts = lane.parts


def test_files_are_dealt_longest_first_to_the_lightest_part() -> None:
    seconds = {"a.py": 10.0, "b.py": 6.0, "c.py": 5.0, "d.py": 1.0}
    tests = {name: 1 for name in seconds}
    assert parts.deal_files(tests, seconds, 2, 2.0) == {"a.py": 1, "b.py": 2, "c.py": 2, "d.py": 1}
    # a file the record does not know weighs its tests at the default
    dealt = parts.deal_files({"a.py": 1, "new.py": 9}, {"a.py": 10.0}, 2, 2.0)
    assert dealt == {"new.py": 1, "a.py": 2}
    assert parts.deal_files(tests, seconds, 1, 2.0) == dict.fromkeys(seconds, 1)


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/2/3"])
def test_a_bad_part_is_refused(text: str) -> None:
    with pytest.raises(parts.PartError):
        parts.parse_part(text)


def _run_part(tmp_path: Path, part: str) -> list[dict[str, Any]]:
    events = tmp_path / f"events-{part.replace('/', 'of')}.jsonl"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / ".ci" / "gpu-lane"), "_pytest", "--part", part,
         str(events), "--", "-m", "not other", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return lane.read_events(events)


def test_the_parts_of_a_run_cover_each_selected_test_once(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    other: deselected\n")
    for name, count in (("one", 5), ("two", 3), ("three", 2), ("four", 1)):
        tests = "".join(f"def test_{i}():\n    pass\n" for i in range(count))
        (tmp_path / f"test_{name}.py").write_text(
            "import pytest\n@pytest.mark.other\ndef test_not_in_the_lane():\n    pass\n" + tests
        )
    ran: list[set[str]] = []
    for part in ("1/2", "2/2"):
        events = _run_part(tmp_path, part)
        summary = lane.summarize(events)
        assert summary["collected"] + summary["deselected"] == 15
        ran.append(
            {e["nodeid"] for e in events if e.get("event") == "report" and e["when"] == "call"}
        )
    assert not ran[0] & ran[1]
    assert len(ran[0] | ran[1]) == 11
    assert all("not_in_the_lane" not in nodeid for nodeid in ran[0] | ran[1])
    files = [{nodeid.split("::")[0] for nodeid in names} for names in ran]
    assert {len(names) for names in ran} == {5, 6}  # five alone, then three + two + one
    assert not files[0] & files[1]


def _part_record(
    part: tuple[int, int],
    *,
    passed: int = 1,
    failed: int = 0,
    commit: str = "a" * 40,
    gpu: str = "NVIDIA H100",
) -> dict[str, Any]:
    events = [
        {"event": "collected", "count": passed + failed},
        {"event": "deselected", "count": 15 - passed - failed},
    ]  # 15 tests in all
    for i in range(passed):
        events.append(
            {
                "event": "report",
                "nodeid": f"p{part[0]}.py::test_{i}",
                "when": "call",
                "outcome": "passed",
                "duration": 1.5,
            }
        )
    for i in range(failed):
        events.append(
            {
                "event": "report",
                "nodeid": f"p{part[0]}.py::test_f{i}",
                "when": "call",
                "outcome": "failed",
                "message": "AssertionError",
                "duration": 2.0,
            }
        )
    source = {
        "commit": commit,
        "dirty": False,
        "modified": [],
        "missing": [],
        "untracked": [],
        "num_changed": 0,
    }
    return lane.build_record(
        events, source=source, wheels=[], hardware={"gpu": gpu}, command="pytest",
        duration_s=100.0, exit_status=1 if failed else 0, timed_out=False, part=part)  # fmt: skip


def test_the_records_of_all_parts_join_into_one() -> None:
    first, second = _part_record((1, 2), passed=2), _part_record((2, 2), passed=3)
    joined = parts.join_parts([second, first])
    assert joined["counts"]["passed"] == 5 and joined["green"]
    assert joined["collected"] == 5 and joined["deselected"] == 10
    assert joined["file_durations_s"] == {"p1.py": 3.0, "p2.py": 4.5}
    assert [p["part"] for p in joined["parts"]] == [[1, 2], [2, 2]]
    assert joined["duration_s"] == 200.0 and joined["part"] is None
    merged = lane.merge_record(None, joined)
    assert merged["current"] is joined
    red = parts.join_parts([first, _part_record((2, 2), failed=1)])
    assert not red["green"] and red["failures"] == ["p2.py::test_f0"]


def test_parts_that_do_not_make_a_whole_are_refused() -> None:
    with pytest.raises(parts.PartError, match="parts 1..N"):
        parts.join_parts([_part_record((1, 3)), _part_record((2, 3))])
    with pytest.raises(parts.PartError, match="commit"):
        parts.join_parts([_part_record((1, 2)), _part_record((2, 2), commit="b" * 40)])
    with pytest.raises(parts.PartError, match="GPU"):
        parts.join_parts([_part_record((1, 2)), _part_record((2, 2), gpu="NVIDIA H200")])
    with pytest.raises(lane.LaneError, match="part 1/2 alone"):
        lane.merge_record(None, _part_record((1, 2)))


def test_merge_command_joins_the_parts(tmp_path: Path) -> None:
    files = []
    for k in (1, 2):
        files.append(tmp_path / f"part{k}.json")
        files[-1].write_text(json.dumps(_part_record((k, 2))))
    lane_file = tmp_path / "lane.json"
    assert lane.main(["merge", str(files[0]), "--lane-file", str(lane_file)]) == 2
    assert lane.main(["merge", *map(str, files), "--lane-file", str(lane_file)]) == 0
    written = json.loads(lane_file.read_text())
    assert written["current"]["counts"]["passed"] == 2 and len(written["current"]["parts"]) == 2
    assert lane.compact(written["current"])["num_parts"] == 2
