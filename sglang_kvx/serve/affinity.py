"""Data parallelism: a compacted context lives in one DP rank's pool, so its children go there.

SGLang's DP controller spreads requests over ranks by load; a child that lands on another rank
finds no compacted context and is served from the full cache (another answer, another memory
bill). The controller therefore asks ``ContextAffinity`` first:

- a parent (a context to compact) is pinned to the rank that already holds that context under
  other settings, else to the rank holding the fewest pinned contexts;
- any other request whose prompt starts with a pinned context goes to that context's rank (the
  longest such context wins);
- everything else, and any request that names its own ``data_parallel_rank``, is routed by
  SGLang as usual.

Prefixes are matched by polynomial prefix hashes of the token ids. A collision could only send a
request to a less useful rank: which context a request reuses is still decided by exact token
match inside that rank's scheduler. Pins are forgotten least-recently-used beyond ``capacity``;
a pin outliving its context (evicted from the rank's store) only costs that locality.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

_MOD = (1 << 61) - 1  # a Mersenne prime: prefix hashes stay exact Python ints
_BASE = 1_000_003


def prefix_hashes(input_ids: list[int]) -> list[int]:
    """h[i] = hash of input_ids[:i], for i = 0 .. len(input_ids)."""
    hashes = [0]
    h = 0
    for token in input_ids:
        h = (h * _BASE + int(token) + 1) % _MOD
        hashes.append(h)
    return hashes


class ContextAffinity:
    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._rank_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, prefix hash) -> rank
        self._lengths: Counter[int] = Counter()  # pinned context lengths, to probe only those
        self._pins_per_rank: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._rank_of)

    def route(self, input_ids: list[int], is_parent: bool, active_ranks: list[int]) -> int | None:
        """The DP rank this request should go to, or None to leave it to SGLang's load balancing."""
        if not active_ranks:
            return None
        hashes = prefix_hashes(input_ids)
        rank = self._longest_pinned_prefix(hashes, active_ranks)
        if not is_parent:
            return rank
        if rank is None:
            rank = min(active_ranks, key=lambda r: (self._pins_per_rank[r], r))
        self._pin((len(input_ids), hashes[-1]), rank)
        return rank

    def _longest_pinned_prefix(self, hashes: list[int], active_ranks: list[int]) -> int | None:
        n = len(hashes) - 1
        for length in sorted((length for length in self._lengths if length <= n), reverse=True):
            key = (length, hashes[length])
            rank = self._rank_of.get(key)
            if rank is not None and rank in active_ranks:
                self._rank_of.move_to_end(key)
                return rank
        return None

    def _pin(self, key: tuple[int, int], rank: int) -> None:
        previous = self._rank_of.pop(key, None)
        if previous is not None:
            self._forget(key[0], previous)
        self._rank_of[key] = rank
        self._lengths[key[0]] += 1
        self._pins_per_rank[rank] += 1
        while len(self._rank_of) > self.capacity:
            (length, _), old_rank = self._rank_of.popitem(last=False)
            self._forget(length, old_rank)

    def _forget(self, length: int, rank: int) -> None:
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]
        self._pins_per_rank[rank] -= 1
