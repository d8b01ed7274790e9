"""Fixed-size KV blocks: reference counts, a free pool and the prefix cache's block index.

A block is in exactly one of three states:
  * free: refcount 0, no hash; first choice for allocation;
  * in use: refcount > 0 (the number of request block tables holding it), hash optional;
  * evictable: refcount 0 with a hash; its KV is still valid, so a later request with the
    same prefix can take it back. Allocation evicts these only when no free block is
    left, least recently freed first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence

from actors.core.prefix_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable_block_ids: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached_block_ids: dict[BlockHash, int] = {}
        self.evicted: list[tuple[int, BlockHash]] | None = None
        """When a list: (block id, hash) of each cached block allocation evicts, appended
        for the offload tiers (actors/core/kv_offload.py), which take them."""

    # ---- counts ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that hold nothing worth keeping."""
        return len(self._free_block_ids)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable_block_ids)

    @property
    def num_allocatable_blocks(self) -> int:
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_allocatable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or evictable."""
        return len(self._cached_block_ids)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable_block_ids

    # ---- allocation -----------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks with refcount 1; raises if the pool cannot supply them."""
        if num_blocks > self.num_allocatable_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.num_allocatable_blocks} of {self.num_blocks} are allocatable"
            )
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free_block_ids:
                block_id = self._free_block_ids.popleft()
            else:
                block_id, _ = self._evictable_block_ids.popitem(last=False)
                block_hash = self._block_hashes[block_id]
                assert block_hash is not None
                del self._cached_block_ids[block_hash]
                self._block_hashes[block_id] = None
                if self.evicted is not None:
                    self.evicted.append((block_id, block_hash))
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to cached blocks (a prefix-cache hit), reviving evictable ones."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._evictable_block_ids:
                    raise ValueError(f"block {block_id} is free and holds no cached KV")
                del self._evictable_block_ids[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks are released in the order given."""
        for block_id in block_ids:
            ref_count = self._ref_counts[block_id]
            if ref_count <= 0:
                raise ValueError(f"block {block_id} is freed more often than it was taken")
            self._ref_counts[block_id] = ref_count - 1
            if ref_count == 1:
                if self._block_hashes[block_id] is None:
                    self._free_block_ids.append(block_id)
                else:
                    self._evictable_block_ids[block_id] = None

    # ---- prefix cache ---------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached_block_ids.get(block_hash)

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish an in-use block under `block_hash`.

        Returns False (and leaves the block unpublished) when another block already holds
        that hash: the first copy stays the shared one.
        """
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use and cannot be registered")
        if self._block_hashes[block_id] is not None or block_hash in self._cached_block_ids:
            return False
        self._block_hashes[block_id] = block_hash
        self._cached_block_ids[block_hash] = block_id
        return True

    def drop_evictable(self) -> int:
        """Forget the cached KV of every block no request holds (they become free); returns
        how many. Blocks in use keep their hashes: their holders still read them, and
        unpublishing them would only stop other requests from sharing them."""
        num_dropped = len(self._evictable_block_ids)
        for block_id in self._evictable_block_ids:
            del self._cached_block_ids[self._block_hashes[block_id]]  # type: ignore[arg-type]
            self._block_hashes[block_id] = None
            self._free_block_ids.append(block_id)
        self._evictable_block_ids.clear()
        return num_dropped

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken internal invariant."""
        free = set(self._free_block_ids)
        evictable = set(self._evictable_block_ids)
        _require(len(free) == len(self._free_block_ids), "a block is twice in the free list")
        _require(
            not free & evictable, f"blocks both free and evictable: {sorted(free & evictable)}"
        )
        num_in_use = sum(1 for count in self._ref_counts if count > 0)
        _require(
            len(free) + len(evictable) + num_in_use == self.num_blocks,
            f"free {len(free)} + evictable {len(evictable)} + in use {num_in_use} "
            f"!= total {self.num_blocks}",
        )
        for block_id in free:
            _require(
                self._ref_counts[block_id] == 0 and self._block_hashes[block_id] is None,
                f"free block {block_id} has refcount {self._ref_counts[block_id]} or a hash",
            )
        for block_id in evictable:
            _require(
                self._ref_counts[block_id] == 0 and self._block_hashes[block_id] is not None,
                f"evictable block {block_id} has refcount {self._ref_counts[block_id]} or no hash",
            )
        for block_hash, block_id in self._cached_block_ids.items():
            _require(
                self._block_hashes[block_id] == block_hash,
                f"cache index points at block {block_id}, which holds another hash",
            )
        num_hashed = sum(1 for block_hash in self._block_hashes if block_hash is not None)
        _require(
            num_hashed == len(self._cached_block_ids),
            f"{num_hashed} blocks carry a hash but the index holds {len(self._cached_block_ids)}",
        )

    def check_holders(self, tables: Mapping[str, Sequence[int]]) -> None:
        """Raise AssertionError unless each block's refcount is the number of block tables
        (request id -> block ids) that hold it, no table holds a block twice, and a block in
        several tables is a cached (hashed) one."""
        holders: Counter[int] = Counter()
        for request_id, block_ids in tables.items():
            _require(
                len(set(block_ids)) == len(block_ids),
                f"request {request_id} holds a block twice: {block_ids}",
            )
            holders.update(block_ids)
        for block_id in range(self.num_blocks):
            num_holders = holders.get(block_id, 0)
            _require(
                self._ref_counts[block_id] == num_holders,
                f"block {block_id} has refcount {self._ref_counts[block_id]} but "
                f"{num_holders} block tables hold it",
            )
            _require(
                num_holders <= 1 or self._block_hashes[block_id] is not None,
                f"block {block_id} is in {num_holders} tables but is not a shared cached block",
            )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
