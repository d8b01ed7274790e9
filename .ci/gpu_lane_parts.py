"""Parts of the GPU lane: when the whole lane takes longer than one device call, `gpu-lane
run --part K/N` runs part K of N, and `gpu-lane merge` joins the N records into one.

A part is a set of whole test files (module fixtures are not set up twice). The files are
dealt out longest first, each to the part with the least time so far, by the seconds each
file took in the committed record; the deal depends only on the collected files and that
record, so every part of one commit makes the same deal and the parts cover each test once.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterable, Mapping
from typing import Any


class PartError(ValueError):
    """A part spec or a set of part records that cannot be used (a one-line reason)."""


def parse_part(text: str) -> tuple[int, int]:
    """ "K/N" -> (K, N), 1 <= K <= N."""
    try:
        index_text, count_text = text.split("/")
        index, count = int(index_text), int(count_text)
    except ValueError:
        raise PartError(f"--part wants K/N (e.g. 1/2), not {text!r}") from None
    if not 1 <= index <= count:
        raise PartError(f"--part {text}: K must be between 1 and N")
    return index, count


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def deal_files(
    tests_per_file: Mapping[str, int],
    seconds_per_file: Mapping[str, float],
    num_parts: int,
    default_test_s: float,
) -> dict[str, int]:
    """Test file -> part (1-based), so that the parts' expected seconds are about equal."""
    expected_s = {
        path: seconds_per_file.get(path, count * default_test_s)
        for path, count in tests_per_file.items()
    }
    loads_s = [0.0] * num_parts
    part_of: dict[str, int] = {}
    for path in sorted(expected_s, key=lambda p: (-expected_s[p], p)):
        lightest = min(range(num_parts), key=lambda i: (loads_s[i], i))
        loads_s[lightest] += expected_s[path]
        part_of[path] = lightest + 1
    return part_of


class PartSelector:
    """pytest plugin: after the marks have selected the lane's tests, keep part K's files."""

    def __init__(
        self, part: tuple[int, int], seconds_per_file: Mapping[str, float], default_test_s: float
    ) -> None:
        self.part = part
        self.seconds_per_file = seconds_per_file
        self.default_test_s = default_test_s

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        index, count = self.part
        tests_per_file = collections.Counter(file_of(item.nodeid) for item in items)
        part_of = deal_files(tests_per_file, self.seconds_per_file, count, self.default_test_s)
        kept = [item for item in items if part_of[file_of(item.nodeid)] == index]
        dropped = [item for item in items if part_of[file_of(item.nodeid)] != index]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def make_selector(
    part: tuple[int, int], seconds_per_file: Mapping[str, float], default_test_s: float
) -> Any:
    """A PartSelector whose hook runs after pytest's own `-m` deselection."""
    import pytest

    selector = PartSelector(part, seconds_per_file, default_test_s)
    hook = pytest.hookimpl(trylast=True)(PartSelector.pytest_collection_modifyitems)
    selector.pytest_collection_modifyitems = hook.__get__(selector)  # type: ignore[method-assign]
    return selector


def file_durations(events: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests) from the run's events."""
    seconds: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("event") == "report":
            seconds[file_of(event["nodeid"])] += float(event.get("duration", 0.0))
    return {path: round(total, 2) for path, total in sorted(seconds.items())}


def join_parts(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The records of parts 1..N of one commit on one kind of GPU, as one record."""
    parts = sorted(records, key=lambda r: tuple(r.get("part") or (0, 0)))
    specs = [tuple(r.get("part") or ()) for r in parts]
    count = specs[0][1] if specs and len(specs[0]) == 2 else None
    if count is None or specs != [(k, count) for k in range(1, count + 1)]:
        raise PartError(f"need the records of parts 1..N of one run, got parts {specs}")
    first = parts[0]
    for key, what in ((("source", "commit"), "commit"), (("hardware", "gpu"), "GPU")):
        values = {r[key[0]].get(key[1]) for r in parts}
        if len(values) != 1:
            raise PartError(f"the parts ran on different {what}s: {sorted(map(str, values))}")
    counts = {name: sum(r["counts"][name] for r in parts) for name in first["counts"]}
    skips: collections.Counter[str] = collections.Counter()
    for record in parts:
        skips.update({s["reason"]: s["count"] for s in record["skips"]})
    selected = sum(r["collected"] for r in parts)
    exit_statuses = [r["exit_status"] for r in parts]
    exit_status = None if None in exit_statuses else max(exit_statuses)
    return {
        **first,
        "run_id": uuid.uuid4().hex,
        "time_utc": max(r["time_utc"] for r in parts),
        "duration_s": round(sum(r["duration_s"] for r in parts), 1),
        "source": {**first["source"], "dirty": any(r["source"].get("dirty") for r in parts)},
        "collected": selected,
        "deselected": first["collected"] + first["deselected"] - selected,
        "counts": counts,
        "failures": [n for r in parts for n in r["failures"]],
        "errors": [n for r in parts for n in r["errors"]],
        "messages": {k: v for r in parts for k, v in r["messages"].items()},
        "skips": [{"reason": r, "count": c} for r, c in skips.most_common()],
        "exit_status": exit_status,
        "timed_out": any(r["timed_out"] for r in parts),
        "green": all(r["green"] for r in parts),
        "file_durations_s": {
            k: v for r in parts for k, v in (r.get("file_durations_s") or {}).items()
        },
        "part": None,
        "parts": [
            {"run_id": r["run_id"], "part": r["part"], "time_utc": r["time_utc"],
             "duration_s": r["duration_s"], "invocation": r.get("invocation", "")}
            for r in parts
        ],
    }  # fmt: skip
