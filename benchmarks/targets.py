"""The open issues' targets against the committed results: for each, the latest figure,
the card and commit that measured it, and whether it holds.

    python -m benchmarks.targets                  # every target
    python -m benchmarks.targets --issue 25 26
    python -m benchmarks.targets --results-dir $OUT   # what came back from the GPU machine

The issues set their targets on an H200. A figure measured on another card is listed with
that card's name and never counts as met: an H100's memory is slower and smaller, so its
figures say where the code stands, not whether the target holds. A figure derived from two
results (a ratio, a share) names both, and takes the card only where both ran on it.
"""

from __future__ import annotations

import argparse
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.recording import RESULTS_DIR, load_result
from benchmarks.report import hardware_kind, same_run

TARGET_CARD = "H200"


@dataclass(frozen=True)
class Reading:
    value: float
    entries: tuple[dict[str, Any], ...]
    """The result entries the value came from."""


class Results:
    """The committed result files of one folder, read on first use."""

    def __init__(self, results_dir: Path) -> None:
        self.results_dir = results_dir
        self._loaded: dict[str, dict[str, Any] | None] = {}

    def result(self, name: str) -> dict[str, Any] | None:
        if name not in self._loaded:
            self._loaded[name] = load_result(self.results_dir / f"{name}.json")
        return self._loaded[name]

    def current(self, name: str) -> dict[str, Any] | None:
        result = self.result(name)
        return result.get("current") if result else None


class Reader(ABC):
    """Reads one number from the results; `names` are the results it reads."""

    names: tuple[str, ...]

    @abstractmethod
    def __call__(self, results: Results) -> Reading | None: ...


class Figure(Reader):
    """A figure of a result's current entry."""

    def __init__(self, name: str, key: str) -> None:
        self.names, self.key = (name,), key

    def __call__(self, results: Results) -> Reading | None:
        entry = results.current(self.names[0])
        if entry is None or not _is_number(entry["figures"].get(self.key)):
            return None
        return Reading(float(entry["figures"][self.key]), (entry,))


class Detail(Reader):
    """A number picked from a result's current details (None where it is missing)."""

    def __init__(self, name: str, pick: Callable[[dict[str, Any]], Any]) -> None:
        self.names, self.pick = (name,), pick

    def __call__(self, results: Results) -> Reading | None:
        entry = results.current(self.names[0])
        if entry is None:
            return None
        try:
            value = self.pick(entry["details"])
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        return Reading(float(value), (entry,)) if _is_number(value) else None


class Ratio(Reader):
    def __init__(self, numerator: Reader, denominator: Reader) -> None:
        self.numerator, self.denominator = numerator, denominator
        self.names = numerator.names + denominator.names

    def __call__(self, results: Results) -> Reading | None:
        top, bottom = self.numerator(results), self.denominator(results)
        if top is None or bottom is None or not bottom.value:
            return None
        return Reading(top.value / bottom.value, top.entries + bottom.entries)


class BeforeCommit(Reader):
    """A figure of the latest entry of a result's history measured at `commit` (the tree
    before a change, for a with/without target) with its current entry's workload and card."""

    def __init__(self, name: str, key: str, commit: str) -> None:
        self.names, self.key, self.commit = (name,), key, commit

    def __call__(self, results: Results) -> Reading | None:
        result = results.result(self.names[0])
        if not result or not result.get("current"):
            return None
        current = result["current"]
        for entry in reversed(result.get("history", [])):
            if same_run(entry, current) and str(entry.get("commit")).startswith(self.commit):
                if _is_number(entry["figures"].get(self.key)):
                    return Reading(float(entry["figures"][self.key]), (entry,))
        return None


@dataclass(frozen=True)
class Target:
    issue: int
    what: str
    read: Reader
    bound: float | None = None
    """None: a figure the issue asks to report, with no bound."""
    at_most: bool = False
    unit: str = ""

    def holds(self, value: float) -> bool | None:
        if self.bound is None:
            return None
        return value <= self.bound if self.at_most else value >= self.bound


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def status(target: Target, reading: Reading | None) -> str:
    if reading is None:
        return "not measured"
    cards = {hardware_kind(entry) for entry in reading.entries}
    on_target_card = len(cards) == 1 and TARGET_CARD in next(iter(cards))
    holds = target.holds(reading.value)
    if holds is None:
        return "reported" if on_target_card else "reported (not on an H200)"
    verdict = "met" if holds else "not met"
    return verdict if on_target_card else f"{verdict} on {' + '.join(sorted(cards))} only"


def describe(target: Target, reading: Reading | None) -> str:
    bound = ""
    if target.bound is not None:
        bound = f"{'<=' if target.at_most else '>='} {_number(target.bound)}{target.unit}"
    value = "-" if reading is None else f"{_number(reading.value)}{target.unit}"
    sources = ""
    if reading is not None:
        named = (
            f"{hardware_kind(e)} {str(e.get('commit'))[:7]} {str(e.get('date'))[:10]}"
            for e in reading.entries
        )
        sources = "; ".join(dict.fromkeys(named))
    return (
        f"#{target.issue} {target.what}: {value} (target {bound or 'reported'}) "
        f"- {status(target, reading)}" + (f" [{sources}]" if sources else "")
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.targets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--issue", type=int, nargs="*", help="only these issues' targets")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.target_list import TARGETS

    args = parse_args(argv)
    results = Results(args.results_dir)
    for target in TARGETS:
        if not args.issue or target.issue in args.issue:
            print(describe(target, target.read(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
