"""A child's usage as SGLang defines it: its real prompt, and the prompt tokens it did not prefill.

A child's request carries S placeholders for its context's n tokens (``serve/admission.py``), so the
scheduler's own counts see a prompt of S + q tokens of which S were cached. The scheduler process
adds, to every output of a child, the n - S tokens SGLang did not see and where they came from
(``kvx_usage``: the compacted pool, or host memory or disk when the context was restored). Here, in
the HTTP process, before the tokenizer manager reads an output batch, each such item's counts are
corrected where SGLang keeps them -- ``prompt_tokens`` (+ n - S), ``cached_tokens`` (the context's n
tokens instead of its S slots) and ``cached_tokens_details`` (SGLang's ``device`` / ``host`` /
``storage`` keep what SGLang's own caches served, the extension's sources ``kvx_pool`` /
``kvx_host`` / ``kvx_disk`` are added) -- so that ``meta_info``, the OpenAI routes' ``usage``
(streamed too), tracing and SGLang's Prometheus counters all read the same truth.
``sglang:cached_tokens_total`` counts only SGLang's literal sources; its ``kvx_*`` samples are added
where SGLang observes a finished request.
"""

from __future__ import annotations

from typing import Any

USAGE_KEY = "kvx_usage"  # the scheduler's per-output field (serve/runtime.py: Runtime.usage_of)
SOURCES = ("kvx_pool", "kvx_host", "kvx_disk")


def correct_child_counts(recv_obj: Any) -> None:
    """An output batch's counts corrected for its children (``kvx_usage`` consumed: it never reaches a
    client). Wraps the one function every output batch passes through in the HTTP process."""
    from sglang.srt.managers.io_struct import unwrap_from_pickle

    info = unwrap_from_pickle(getattr(recv_obj, "customized_info", None))
    if not isinstance(info, dict) or USAGE_KEY not in info:
        return
    usage = info.pop(USAGE_KEY)
    recv_obj.customized_info = info or None
    details = getattr(recv_obj, "cached_tokens_details", None)
    for i, entries in enumerate(usage):
        if not entries:
            continue
        hidden, source = int(entries[-1]["hidden"]), entries[-1]["source"]
        recv_obj.prompt_tokens[i] += hidden
        slots = recv_obj.cached_tokens[i]  # SGLang counted the context's S slots as a device hit
        context = int(entries[-1]["context_tokens"])
        recv_obj.cached_tokens[i] = slots + hidden
        if details is not None and i < len(details):
            own = dict(details[i] or {"device": 0, "host": 0})
            own["device"] = max(0, int(own.get("device", 0)) - (context - hidden))  # the slots were ours, not the tree's
            own[source] = context
            details[i] = own


def around_handle_batch_output(original, manager, recv_obj, *args, **kwargs):
    correct_child_counts(recv_obj)
    return original(manager, recv_obj, *args, **kwargs)


def after_observe_one_finished_request(result, collector, labels, *args, **kwargs):
    """``sglang:cached_tokens_total{cache_source="kvx_*"}``: SGLang's collector counts only its own
    literal sources; the extension's are added beside them, from the same corrected details."""
    details = kwargs.get("cached_tokens_details")
    if details is None and len(args) >= 6:
        details = args[5]
    for source in SOURCES:
        value = (details or {}).get(source, 0)
        if value > 0:
            collector.cached_tokens_total.labels(**labels, cache_source=source).inc(value)
    return result
