from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.frontend.stop_checker import StopStringChecker


def run(stop, pieces, include=False):
    """Feed pieces until a stop string fires; return (streamed pieces, stop string, final
    text including what a finish without a stop string releases)."""
    checker = StopStringChecker(stop, include)
    streamed = []
    for piece in pieces:
        result = checker.append(piece)
        streamed.append(result.text)
        if result.stop_string is not None:
            return streamed, result.stop_string, "".join(streamed)
    streamed.append(checker.flush())
    return streamed, None, "".join(streamed)


def reference(stop, text, include=False):
    """Character by character: the first position where some stop string ends wins; among
    those ending there, the longest (it starts first)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            match = max(ending, key=len)
            return (text[:end] if include else text[: end - len(match)]), match
    return text, None


def test_stop_string_split_across_token_boundaries():
    streamed, stop, text = run(["STOP"], ["Hel", "lo ST", "OP now"])
    assert stop == "STOP"
    assert text == "Hello "
    assert streamed == ["Hel", "lo ", ""]


def test_text_after_the_stop_string_is_cut_and_the_stop_string_excluded():
    _, stop, text = run(["STOP"], ["abcSTOPdef STOP"])
    assert (stop, text) == ("STOP", "abc")


def test_include_stop_str_in_output_keeps_the_stop_string_only():
    _, stop, text = run(["STOP"], ["Hel", "lo ST", "OP now"], include=True)
    assert (stop, text) == ("STOP", "Hello STOP")


def test_no_partial_stop_string_leaks_while_it_may_still_match():
    streamed, stop, _ = run(["STOP"], ["Hello S", "T", "O", "P"])
    assert streamed == ["Hello ", "", "", ""] and stop == "STOP"


def test_held_text_is_released_once_it_can_no_longer_match():
    streamed, stop, text = run(["STOP"], ["Hello ST", "ART", " now"])
    assert stop is None
    assert streamed == ["Hello ", "START", " now", ""]
    assert text == "Hello START now"


def test_a_restarting_candidate_releases_only_the_part_that_cannot_match():
    streamed, stop, text = run(["STOP"], ["S", "T", "S", "T", "O", "P"])
    assert streamed == ["", "", "ST", "", "", ""]
    assert (stop, text) == ("STOP", "ST")


def test_held_text_is_released_by_flush():
    checker = StopStringChecker(["</answer>"], False)
    assert checker.append("done </ans").text == "done "
    assert checker.pending_text == "</ans"
    assert checker.flush() == "</ans"
    assert checker.pending_text == ""


@pytest.mark.parametrize(
    "stop, text, expected_text, expected_stop",
    [
        (["abc", "bcd"], "xabcd", "x", "abc"),  # "abc" completes first
        (["bcd", "abcdef"], "abcdefg", "a", "bcd"),  # the shorter one completes first
        (["abcd", "bc"], "abcd", "a", "bc"),  # inner candidate completes first
        (["bc", "abc"], "abc", "", "abc"),  # both end together: the longer wins
    ],
)
@pytest.mark.parametrize("reverse", [False, True])
def test_overlapping_candidates_first_completed_wins_whatever_the_list_order(
    stop, text, expected_text, expected_stop, reverse
):
    stops = list(reversed(stop)) if reverse else stop
    for pieces in ([text], list(text)):
        _, matched, streamed = run(stops, pieces)
        assert (streamed, matched) == (expected_text, expected_stop)


def test_several_stop_strings_report_which_one_fired():
    stops = ["\n\n", "User:", "###"]
    assert run(stops, ["Answer: 4.", "\nUser", ": hi"])[1:] == ("User:", "Answer: 4.\n")
    assert run(stops, ["Answer: 4.", "\n", "\nUser: hi"])[1:] == ("\n\n", "Answer: 4.")
    assert run(stops, ["## not", " a ###"])[1:] == ("###", "## not a ")


def test_unchecked_text_cannot_fire_but_a_match_completing_later_does():
    checker = StopStringChecker(["STOP"], False)
    # While output is shorter than min_tokens, a complete stop string does not fire...
    assert checker.append("a STOP b ST", check=False) == ("a STOP b ", None)
    # ...but a partial one held back then completes once checking starts.
    assert checker.append("OP", check=True) == ("", "STOP")


def test_without_stop_strings_text_passes_through():
    checker = StopStringChecker([], False)
    assert checker.append("anything") == ("anything", None)
    assert checker.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringChecker(["ok", ""], False)


@st.composite
def chunked(draw, text):
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    text=st.text(alphabet="ab c", max_size=24),
    stop=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_any_chunking_matches_the_character_by_character_reference(data, text, stop, include):
    pieces = data.draw(chunked(text))
    _, matched, final = run(stop, pieces, include)
    assert (final, matched) == reference(stop, text, include)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    text=st.text(alphabet="ab c", max_size=24),
    stop=st.lists(st.text(alphabet="ab c", min_size=2, max_size=4), min_size=1, max_size=3),
)
def test_only_a_possible_stop_string_start_is_held_back(data, text, stop):
    checker = StopStringChecker(stop, False)
    seen = emitted = ""
    for piece in data.draw(chunked(text)):
        seen += piece
        result = checker.append(piece)
        emitted += result.text
        if result.stop_string is not None:
            return
        held = checker.pending_text
        assert emitted + held == seen
        assert held == "" or any(s.startswith(held) and len(held) < len(s) for s in stop)
        # Nothing longer could still grow into a stop string (the hold is the longest).
        longer = seen[len(seen) - len(held) - 1 :] if len(held) < len(seen) else None
        assert longer is None or not any(s.startswith(longer) for s in stop)
