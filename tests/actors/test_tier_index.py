"""The host tier's index (actors/core/tier_index.py): least-recently-used eviction, pins that
hold a step's slots until it takes its copies, and clearing."""

from __future__ import annotations

import pytest

from actors.core.tier_index import TierIndex


def test_tier_index_evicts_least_recently_used_unpinned_slot() -> None:
    index = TierIndex(2)
    slot_a, evicted = index.insert(b"a")  # type: ignore[misc]
    assert evicted is None
    slot_b, _ = index.insert(b"b")  # type: ignore[misc]
    index.release_pins()
    assert index.lookup(b"a") == slot_a  # a is now the most recent (and pinned)
    index.release_pins()
    assert index.insert(b"c") == (slot_b, b"b")
    assert b"b" not in index and index.lookup(b"c") == slot_b
    index.check_invariants()


def test_pinned_slots_are_never_evicted_within_a_step() -> None:
    index = TierIndex(2)
    index.insert(b"a")
    index.insert(b"b")
    assert index.insert(b"c") is None  # both slots serve copies not yet taken
    index.release_pins()
    assert index.insert(b"c") is not None


def test_clearing_keeps_pinned_slots_until_their_copies_are_taken() -> None:
    index = TierIndex(2)
    slot_a, _ = index.insert(b"a")  # type: ignore[misc]
    assert index.clear() == 1 and len(index) == 0
    slot_b, _ = index.insert(b"b")  # type: ignore[misc]
    assert slot_b != slot_a  # slot a may still be read by this step's copies
    index.release_pins()
    index.check_invariants()


@pytest.mark.parametrize("num_host_slots", [0, -1])
def test_a_tier_needs_at_least_one_slot(num_host_slots: int) -> None:
    with pytest.raises(ValueError):
        TierIndex(num_host_slots)
