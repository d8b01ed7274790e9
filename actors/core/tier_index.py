"""The host tier's index: block hash -> host slot, least recently used first, a fixed number
of slots, and pins that keep the slots a step's copies touch from being reused before the
step takes them (actors/core/kv_offload.py)."""

from __future__ import annotations

from collections import OrderedDict

from actors.core.prefix_hash import BlockHash


class TierIndex:
    """Hash -> slot with least-recently-used order, a fixed number of slots, and pins.

    A pinned slot (touched by copies not yet taken by a step) is never evicted nor freed;
    `release_pins` unpins them all."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recent first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._free_after_release: list[int] = []

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block's slot, made most recently used and pinned; None when absent."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
            self._pinned.add(slot)
        return slot

    def insert(self, block_hash: BlockHash) -> tuple[int, BlockHash | None] | None:
        """A pinned slot for a new block and the hash it evicted (None: it was free); None
        when every slot is pinned. The hash must be absent."""
        if block_hash in self._slots:
            raise ValueError("block hash is already in the tier")
        evicted: BlockHash | None = None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                return None
            evicted = victim
            slot = self._slots.pop(victim)
        self._slots[block_hash] = slot
        self._pinned.add(slot)
        return slot, evicted

    def touch(self, block_hash: BlockHash) -> None:
        """Make the block most recently used, without pinning it."""
        self._slots.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._release(slot)

    def clear(self) -> int:
        """Forget every block; returns how many."""
        num_dropped = len(self._slots)
        for slot in self._slots.values():
            self._release(slot)
        self._slots.clear()
        return num_dropped

    def release_pins(self) -> None:
        self._pinned.clear()
        self._free_slots += self._free_after_release
        self._free_after_release.clear()

    def _release(self, slot: int) -> None:
        # A pinned slot may still be read by copies not yet run: free it after them.
        (self._free_after_release if slot in self._pinned else self._free_slots).append(slot)

    def check_invariants(self) -> None:
        slots = list(self._slots.values())
        every = slots + self._free_slots + self._free_after_release
        if sorted(every) != list(range(self.num_slots)):
            raise AssertionError(f"tier slots are lost or doubled: {sorted(every)}")
