"""Contexts no client marked: a long prompt beginning that plain requests keep repeating.

SGLang's frontend marks a shared context by sending it alone (prefill-only) when a program forks,
but only when the text is already applied at ``fork()`` (its executor thread can lose that race),
and raw HTTP clients that repeat a document with each question mark nothing. ``SharedPrefixes``
watches plain requests (no ``custom_params.kvx``, not a parent, not a child): when one shares at
least ``min_tokens`` leading tokens with the most recent earlier prompt that does, their common
beginning is a context to compact (``--kvx-auto-context-min-tokens``). The runtime queues it as an
internal prefill-only parent under the server's settings; the request that showed the repeat, and
every one arriving while the parent is prefilled and compacted, waits for it in the queue and reads it
as a child (rather than prefilling the same beginning beside the parent), as do requests arriving once
it is stored, as if a client had sent it. With the flag off (0) such prefixes are only counted and
logged, with what to do.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

from sglang_kvx.compact.second_pass import INTERNAL_RID_PREFIX
from sglang_kvx.ports import Request
from sglang_kvx.settings import NO_FIELDS

if TYPE_CHECKING:
    from sglang_kvx.serve.request_state import RequestState

logger = logging.getLogger(__name__)

AUTO_RID_PREFIX = INTERNAL_RID_PREFIX + "shared-prefix-"  # parents of beginnings plain requests repeat

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
        self.recent: deque[tuple] = deque(maxlen=capacity)  # latest plain prompts (namespace, ids), newest last
        self.pending: set[tuple] = set()  # (namespace, prefix) queued as parents, not yet released
        self.seen = 0  # plain requests that repeated a long beginning of an earlier one

    def observe(self, input_ids: Sequence[int], stored_len: int = 0, namespace: tuple | None = None) -> tuple[int, ...] | None:
        """A plain request arrives: the prefix it shares with the most recent earlier prompt of its own
        prefix-cache ``namespace`` sharing at least ``min_tokens`` (and more than ``stored_len``, the
        longest stored context it extends), when that prefix is new; None otherwise. Prompts of two
        namespaces never make one context (one tenant's salted prompt must not become another's)."""
        ids = tuple(int(t) for t in input_ids)
        found = None
        for other_namespace, other in reversed(self.recent):
            if other_namespace != namespace:
                continue
            shared = common_prefix_len(ids, other, self.threshold)
            if shared >= self.threshold and shared < len(ids):
                found = ids[:shared]
                break
        self.recent.append((namespace, ids))
        if found is None or len(found) <= stored_len:
            return None
        self.seen += 1
        if (namespace, found) in self.pending:
            return None
        return found


class AutoContexts:
    """The parents the server queues itself for the beginnings plain requests repeat
    (``--kvx-auto-context-min-tokens``), or the log line saying what to do (flag off)."""

    def __init__(self, min_tokens: int, submit: Callable[..., None], settings_in: Callable[[Any], Any],
                 compacts: bool) -> None:
        self.compacts = compacts  # the server's own policy compacts (auto-contexts take its settings)
        self.shared = SharedPrefixes(min_tokens)
        self.submit = submit  # (rid, token ids, compact) -> a prefill-only request into the scheduler's queue
        # namespace -> the settings its parents are compacted with (the server's); asked each round a request
        # waits, so resolved once per recent namespace (clients choose salts: bounded)
        self._settings_of = functools.lru_cache(maxsize=256)(settings_in)
        self.queued = 0  # parents queued for shared beginnings

    @staticmethod
    def is_own(rid: str) -> bool:
        """Whether a request is a parent this server queued itself (no client waits for it)."""
        return rid.startswith(AUTO_RID_PREFIX)

    def waits(self, request: Request, state: RequestState) -> bool:
        """A request with no context, its ``RequestState``: seen for the first time, plain and unmarked
        (no ``custom_params.kvx``, not a parent) on a compacting server, whether it now waits for a long
        beginning it repeats, queued as the server's own parent (``observe``)."""
        if state.prefix_checked or state.parent or state.internal:
            return False
        state.prefix_checked = True
        return state.fields == NO_FIELDS and self.compacts and self.observe(request)

    def observe(self, request: Request) -> bool:
        """A plain, unmarked request arrives: queue the long beginning it repeats as a parent; whether a
        parent of ours (this one or one queued before) now makes a context the request extends."""
        prefix = self.shared.observe(request.input_ids, namespace=request.namespace)
        if prefix is None:
            return self._pending(request.input_ids, lambda namespace: namespace == request.namespace)
        shared = self.shared
        if shared.min_tokens == 0:
            if shared.seen == 1 or shared.seen % 100 == 0:
                logger.warning("sglang_kvx: %d plain requests repeated a beginning of %d+ tokens that no client marked "
                               "as a context (e.g. a %d-token one); send it once with max_new_tokens 0, or serve with "
                               "--kvx-auto-context-min-tokens", shared.seen, shared.threshold, len(prefix))
            return False
        shared.pending.add((request.namespace, prefix))
        self.queued += 1
        self.submit(f"{AUTO_RID_PREFIX}{self.queued}", list(prefix), True, request.namespace)
        logger.info("sglang_kvx: compacting a %d-token beginning that plain requests repeat", len(prefix))
        return True

    def pending_for(self, prompt_ids: Sequence[int], settings: Any) -> bool:
        """Whether a parent of ours not yet released makes a context ``prompt_ids`` strictly extends with
        ``settings`` (None: with any)."""
        return self._pending(prompt_ids, lambda namespace: settings is None or (
            settings.namespace == namespace and settings == self._settings_of(namespace)))

    def _pending(self, prompt_ids: Sequence[int], namespace_fits: Callable[[Any], bool]) -> bool:
        return any(len(prefix) < len(prompt_ids) and namespace_fits(namespace)
                   and tuple(int(t) for t in prompt_ids[:len(prefix)]) == prefix
                   for namespace, prefix in self.shared.pending)

    def released(self, request: Request) -> None:
        """A parent of ours finished: its beginning may be queued again once it is gone from the store."""
        if request.finished and self.is_own(request.rid):
            self.shared.pending.discard((request.namespace, tuple(int(t) for t in request.input_ids)))
