"""Which sliding-window rings are saved, for prefix caching beside rings (worker/window_ring.py).

A layer with a window keeps only a row's last positions, in a ring, so a cached prefix's blocks
hold the global layers' K/V alone. To restore a prefix the window layers need its last
``window`` positions too: the worker keeps ``capacity`` snapshots of a row's rings, each taken
where a sequence stood at a block boundary (a prompt's end, a request's release), and this
index names each by the prefix hash of the block ending there, so it holds exactly that
prefix's tokens. A new row adopts a cached prefix only up to the longest boundary with a
snapshot, which it restores into its ring; past that, its tokens are computed. Least recently
used snapshots go first.
"""

from __future__ import annotations

from collections import OrderedDict

from nanoserve.cache.prefix_cache import BlockHash


class RingSnapshots:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"ring snapshots need a capacity of at least 0, got {capacity}")
        self.capacity = capacity
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # prefix hash -> snapshot slot, oldest use first
        self.saved = self.restored = 0

    def __len__(self) -> int:
        return len(self._slots)

    def longest(self, hashes: list[BlockHash]) -> int:
        """How many of these prefix hashes (a sequence's full blocks, in order) lead to the
        longest one with a snapshot: 0 when none has one."""
        for blocks in range(len(hashes), 0, -1):
            if hashes[blocks - 1] in self._slots:
                return blocks
        return 0

    def restore(self, key: BlockHash) -> int:
        """The slot holding ``key``'s snapshot (now the most recently used)."""
        self._slots.move_to_end(key)
        self.restored += 1
        return self._slots[key]

    def take(self, key: BlockHash) -> int | None:
        """A slot to save ``key``'s snapshot into (the least recently used one's when every slot
        is taken), or None when it is already saved (it is the same tokens' K/V) or none is kept."""
        if key in self._slots or not self.capacity:
            if key in self._slots:
                self._slots.move_to_end(key)
            return None
        if len(self._slots) < self.capacity:
            slot = len(self._slots)
        else:
            _, slot = self._slots.popitem(last=False)
        self._slots[key] = slot
        self.saved += 1
        return slot
