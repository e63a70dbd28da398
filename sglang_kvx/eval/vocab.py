"""Word pools, needle values and filler text for the evaluation tasks.

Everything here is drawn from the demo tokenizer's word list (``WORDS``), digits and
the punctuation its training corpus used, so needles share the filler's vocabulary:
a key is a hyphen compound of two filler words ("river-salt"), a value is a digit
string, and the essay filler itself mixes single words, compounds and numbers. A
model (or a write gate) cannot tell a needle from the haystack by token identity.

Every stream here is prefix-stable: asking for n + 1 words returns the n-word text
plus one word, which is what lets the length fitter binary-search on filler size.
"""

from __future__ import annotations

import random

from sglang_kvx.models.tokenizer import WORDS

# Words that carry grammar or that the task templates use; never a key or a name.
FUNCTION_WORDS = frozenset(
    "the a an of to and in is it that for on was with as by at from this be are or not "
    "have has had what which who where when why how all some many most few please tell me "
    "give return only key value number word special magic needle question answer "
    "variable assign equal copy repeat".split()
)
# A word that is a proper prefix or suffix of another ("read" in "bread") would let
# one compound be a substring of another and fool the substring scorer: dropped.
_AMBIGUOUS = frozenset(
    a for a in WORDS for b in WORDS if a != b and (b.startswith(a) or b.endswith(a))
)
NAME_WORDS: tuple[str, ...] = tuple(w for w in WORDS if w not in FUNCTION_WORDS and w not in _AMBIGUOUS)
# All hyphen compounds "a-b" of two different name words, in a fixed order.
COMPOUNDS: tuple[str, ...] = tuple(f"{a}-{b}" for a in NAME_WORDS for b in NAME_WORDS if a != b)

COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple", "gray", "brown")
ANIMALS = ("cat", "dog", "bird", "fish", "horse", "tiger", "lion", "bear", "wolf", "fox")
FOODS = ("apple", "bread", "cheese", "honey", "lemon", "olive", "pepper", "rice", "salt", "sugar")

# RULER's noise haystack repeats "The grass is green. The sky is blue. The sun is
# yellow. Here we go. There and back again." Same shape, filler words only.
NOISE_BLOCK = (
    "The garden is green.",
    "The river is blue.",
    "The lemon is yellow.",
    "One two three.",
    "Walk to the bridge and run to the house.",
)


def rng_for(*parts: object) -> random.Random:
    """A random.Random seeded by a string key: stable across runs and Python versions."""
    return random.Random("|".join(str(p) for p in parts))


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A number with exactly ``digits`` digits (RULER's needle values are 7 digits)."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_long_id(rng: random.Random) -> str:
    """RULER's uuid needles, rebuilt from filler vocabulary: five hyphen-joined parts,
    four name words and a 4-digit group ("fox-river-4821-salt-dark"). Long, many
    tokens and high entropy like a uuid, but no hex letters foreign to the filler."""
    parts = [rng.choice(NAME_WORDS) for _ in range(4)]
    parts.insert(2, random_number(rng, 4))
    return "-".join(parts)


def random_item(rng: random.Random, kind: str) -> str:
    """One needle key or value of RULER's type ``kind``: words, numbers or uuids."""
    if kind == "words":
        return rng.choice(COMPOUNDS)
    if kind == "numbers":
        return random_number(rng)
    if kind == "uuids":
        return random_long_id(rng)
    raise ValueError(f"unknown needle type {kind!r}; valid: words, numbers, uuids")


def distinct_items(rng: random.Random, kind: str, count: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """``count`` different items of ``kind``, none in ``exclude``."""
    items: list[str] = []
    seen = set(exclude)
    while len(items) < count:
        item = random_item(rng, kind)
        if item not in seen:
            seen.add(item)
            items.append(item)
    return items


class ItemStream:
    """An endless, prefix-stable stream of items of one kind that avoids ``exclude``.

    Compounds come from a seeded permutation of all compounds (no repeats until the
    pool of ~9.7K is used up); numbers and long ids are drawn one by one.
    """

    def __init__(self, rng: random.Random, kind: str, exclude: set[str] | frozenset[str] = frozenset()):
        self.rng, self.kind, self.exclude = rng, kind, frozenset(exclude)
        self.items: list[str] = []
        self._order: list[int] = []
        self._pos = 0

    def _next(self) -> str:
        if self.kind != "words":
            return random_item(self.rng, self.kind)
        if self._pos == len(self._order):
            self._order = list(range(len(COMPOUNDS)))
            self.rng.shuffle(self._order)
            self._pos = 0
        self._pos += 1
        return COMPOUNDS[self._order[self._pos - 1]]

    def take(self, n: int) -> list[str]:
        while len(self.items) < n:
            item = self._next()
            if item not in self.exclude:
                self.items.append(item)
        return self.items[:n]


class EssayStream:
    """Essay-like filler: sentences of 6-16 filler words, some with a number or a
    compound (the demo tokenizer's training-corpus distribution), prefix-stable.

    ``take(n)`` returns sentences holding exactly n words (a number or a compound
    counts as one word); the last sentence is cut and closed with a period.
    """

    def __init__(self, rng: random.Random, exclude: set[str] | frozenset[str] = frozenset()):
        self.rng, self.exclude = rng, frozenset(exclude)
        self.sentences: list[tuple[list[str], str]] = []  # (words, end mark)
        self.num_words = 0

    def _add_sentence(self) -> None:
        rng = self.rng
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
        if rng.random() < 0.4:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        if rng.random() < 0.25:
            compound = rng.choice(COMPOUNDS)
            while compound in self.exclude:
                compound = rng.choice(COMPOUNDS)
            words.insert(rng.randrange(len(words) + 1), compound)
        words[0] = words[0][0].upper() + words[0][1:]
        end = rng.choices((".", "?", ":"), weights=(8, 1, 1))[0]
        self.sentences.append((words, end))
        self.num_words += len(words)

    def take(self, n: int) -> list[str]:
        while self.num_words < n:
            self._add_sentence()
        out: list[str] = []
        left = n
        for words, end in self.sentences:
            if left <= 0:
                break
            cut = words[:left]
            out.append(" ".join(cut) + (end if len(cut) == len(words) else "."))
            left -= len(cut)
        return out


def noise_lines(n_words: int) -> list[str]:
    """RULER's noise haystack: the noise block repeated, one block per line, holding
    exactly ``n_words`` words; the last block is cut at a word and closed with a period."""
    block = " ".join(NOISE_BLOCK).split(" ")
    lines: list[str] = []
    while n_words > 0:
        cut = block[:n_words]
        line = " ".join(cut)
        lines.append(line if line.endswith(".") else line + ".")
        n_words -= len(cut)
    return lines
