"""Contexts no client marked: a long prompt beginning that plain requests keep repeating.

SGLang's frontend marks a shared context by sending it alone (prefill-only) when a program forks,
but only when the text is already applied at ``fork()`` (its executor thread can lose that race),
and raw HTTP clients that repeat a document with each question mark nothing. ``SharedPrefixes``
watches plain requests (no ``custom_params.kvx``, not a parent, not a child): when one shares at
least ``min_tokens`` leading tokens with the most recent earlier prompt that does, their common
beginning is a context to compact (``--kvx-auto-context-min-tokens``). The runtime queues it as an
internal prefill-only parent under the server's settings; requests that arrive once it is stored
are its children, as if a client had sent it. With the flag off (0) such prefixes are only counted
and logged, with what to do.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence


WARN_MIN_TOKENS = 1024  # with the flag off: a repeated beginning this long is logged (once each)


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...], at_least: int = 0) -> int:
    """Length of the common beginning of ``a`` and ``b`` (0 when shorter than ``at_least``): a
    binary search on tuple slices, whose comparisons run in C."""
    n = min(len(a), len(b))
    if n < at_least or a[:at_least] != b[:at_least]:
        return 0
    lo, hi = at_least, n  # a[:lo] == b[:lo]; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SharedPrefixes:
    def __init__(self, min_tokens: int, capacity: int = 32) -> None:
        self.min_tokens = min_tokens  # 0: detect (WARN_MIN_TOKENS) and log only
        self.threshold = min_tokens or WARN_MIN_TOKENS
        self.recent: deque[tuple[int, ...]] = deque(maxlen=capacity)  # latest plain prompts, newest last
        self.pending: set[tuple[int, ...]] = set()  # prefixes queued as parents, not yet released
        self.seen = 0  # plain requests that repeated a long beginning of an earlier one

    def observe(self, input_ids: Sequence[int], stored_len: int = 0) -> tuple[int, ...] | None:
        """A plain request arrives: the prefix it shares with the most recent earlier prompt sharing
        at least ``min_tokens`` (and more than ``stored_len``, the longest stored context it extends),
        when that prefix is new; None otherwise."""
        ids = tuple(int(t) for t in input_ids)
        found = None
        for other in reversed(self.recent):
            shared = common_prefix_len(ids, other, self.threshold)
            if shared >= self.threshold and shared < len(ids):
                found = ids[:shared]
                break
        self.recent.append(ids)
        if found is None or len(found) <= stored_len:
            return None
        self.seen += 1
        if found in self.pending:
            return None
        return found
