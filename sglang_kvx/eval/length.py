"""Token counting with any tokenizer, and fitting a sample's filler to a token budget."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

T = TypeVar("T")

# A generated prompt (context + question) holds between (1 - TOLERANCE) * target and
# target tokens: the filler size is the largest whose prompt still fits, as in RULER.
LENGTH_TOLERANCE = 0.02


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """The demo models' tokenizer (byte-level BPE, 512 tokens), from weights/tiny-hybrid."""
    from transformers import AutoTokenizer

    from sglang_kvx.models.demo import demo_model_path

    return AutoTokenizer.from_pretrained(str(demo_model_path("tiny-hybrid")))


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, from anything with ``encode``
    (HF tokenizers, tiktoken-like) or a ``__call__`` returning ids or {"input_ids": ...}."""
    fn = getattr(tokenizer, "encode", None)
    if fn is not None:
        try:
            ids = fn(text, add_special_tokens=False)
        except TypeError:
            ids = fn(text)
    else:
        try:
            ids = tokenizer(text, add_special_tokens=False)
        except TypeError:
            ids = tokenizer(text)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    elif hasattr(ids, "ids"):  # a tokenizers.Encoding
        ids = ids.ids
    return list(ids)


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(encode(tokenizer, text))


def fit_largest(build: Callable[[int], T], measure: Callable[[T], int], target: int, minimum: int = 0) -> tuple[int, T]:
    """The largest size n >= minimum whose ``measure(build(n))`` is at most ``target``,
    with its build. Assumes the measure grows with n (it may wobble: the search keeps
    one size that fits and one that does not, and returns the fitting one next to it).
    Raises ValueError when even ``minimum`` does not fit."""
    lo, lo_item = minimum, build(minimum)
    base = measure(lo_item)
    if base > target:
        raise ValueError(f"target of {target} tokens is too small: the shortest sample has {base}")
    # Grow by the tokens-per-unit rate seen so far, aiming 10% past the target, so
    # nothing much longer than the target is ever built; then bisect.
    probe = minimum + 1
    while True:
        if probe > minimum + 64 * (target + 1):
            raise RuntimeError("the sample does not grow with its filler size")
        item = build(probe)
        tokens = measure(item)
        if tokens > target:
            hi = probe
            break
        lo, lo_item = probe, item
        rate = (tokens - base) / (probe - minimum)
        jump = int((target - tokens) / rate * 1.1) + 1 if rate > 0 else probe - minimum
        probe += max(1, jump)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        item = build(mid)
        if measure(item) <= target:
            lo, lo_item = mid, item
        else:
            hi = mid
    return lo, lo_item
