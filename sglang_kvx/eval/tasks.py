"""RULER's thirteen tasks, generated offline, seeded, and fitted to a token budget.

Shapes follow NVIDIA/RULER (scripts/synthetic.yaml, scripts/data/synthetic/*.py and
their templates in scripts/data/synthetic/constants.py); the code is ours. What differs
is the material: no Paul Graham essays, wonderwords, SQuAD or HotpotQA downloads.
Haystacks, keys, values and documents come from the demo tokenizer's word list (see
vocab.py), so needles share the filler vocabulary.

| task | RULER definition (synthetic.yaml) | here |
| --- | --- | --- |
| niah_single_1 | noise haystack, key words, value numbers, 1 key/value/query | same (noise block from filler words) |
| niah_single_2 | essay haystack, words -> numbers, 1/1/1 | generated essay |
| niah_single_3 | essay haystack, words -> uuids, 1/1/1 | uuid-shaped ids from filler words |
| niah_multikey_1 | essay, words -> numbers, 4 keys, 1 value, 1 query | same |
| niah_multikey_2 | needle haystack (every line a needle), words -> numbers, 1/1/1 | same, plus at most one short filler line to land on the length |
| niah_multikey_3 | needle haystack, uuids -> uuids, 1/1/1 | same |
| niah_multivalue | essay, words -> numbers, 1 key, 4 values, 1 query | same |
| niah_multiquery | essay, words -> numbers, 4 keys, 1 value each, 4 queries | same |
| vt | noise haystack, 1 chain, 4 hops, one in-context example | names are compounds, "VAR X = Y" reads "Variable X equal Y" |
| cwe | numbered word list, 10 common words x30, others x3 (x6/x1 below 4K), one example | compounds as words; below what RULER's small setting fits, no example and x3/x1 |
| fwe | coded words with zeta(alpha=2) counts, vocab = length/50, top word is '...' | compounds as coded words |
| qa_1 | SQuAD: one gold paragraph among distractor paragraphs | generated entity documents, one-hop question |
| qa_2 | HotpotQA: question needs two documents (bridge) | generated documents, "the X of the city of E" |

Each prompt is ``context + question``: the context is the long shared part (instructions,
haystack, ending in a newline) and the question restates the needle's wording and ends
with RULER's answer prefix, so the answer is a continuation. A prompt holds between 98%
and 100% of the target token count (largest filler that fits, as RULER sizes its
haystack). Everything is deterministic per (task, target length, seed, index) and
tokenizer.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from sglang_kvx.eval.length import count_tokens, default_tokenizer, fit_largest
from sglang_kvx.eval.vocab import (
    ANIMALS,
    COLORS,
    FOODS,
    EssayStream,
    ItemStream,
    distinct_items,
    noise_lines,
    random_number,
    rng_for,
)

# RULER's needle depths: np.round(np.linspace(0, 100, num=40)).
DEPTHS = tuple(round(100 * i / 39) for i in range(40))


@dataclass
class Sample:
    """One prompt: ``context + question``; the model's continuation is scored against ``answers``."""

    task: str
    context: str
    question: str
    answers: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return self.context + self.question


class Turn(NamedTuple):
    question: str
    answers: list[str]


@dataclass
class Session:
    """SCBench's same-context-different-queries shape: prefill ``context`` once (the
    parent), then answer each ``turns[i].question`` as a child of it."""

    task: str
    context: str
    turns: list[Turn]
    metadata: dict[str, Any] = field(default_factory=dict)

    def sample(self, i: int = 0) -> Sample:
        """Turn i as a standalone sample (its needles only, its own length)."""
        meta = {k: v for k, v in self.metadata.items() if k not in ("needles", "lengths", "answer_prefixes")}
        meta["length"] = self.metadata["lengths"][i]
        meta["answer_prefix"] = self.metadata["answer_prefixes"][i]
        meta["question_index"] = i
        meta["needles"] = [n for n in self.metadata["needles"] if not n["questions"] or i in n["questions"]]
        turn = self.turns[i]
        return Sample(self.task, self.context, turn.question, list(turn.answers), meta)


# A context is built as pieces; a piece with an info dict is a needle whose char and
# token spans end up in the metadata.
Piece = tuple[str, "dict[str, Any] | None"]


@dataclass
class Draft:
    pieces: list[Piece]
    questions: list[str]  # each ends with its answer prefix
    answers: list[list[str]]
    prefixes: list[str]  # the answer prefix closing each question
    info: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def context(self) -> str:
        return "".join(text for text, _ in self.pieces)


def weave(lines: list[str], needles: list[Piece], depths: list[float], sep: str) -> list[Piece]:
    """Insert needle k before line int(len(lines) * depths[k] / 100) (depths sorted, as
    RULER places needles at sentence boundaries) and join everything with ``sep``."""
    slots = [int(len(lines) * d / 100) for d in depths]
    ordered: list[Piece] = []
    k = 0
    for i in range(len(lines) + 1):
        while k < len(needles) and slots[k] <= i:
            ordered.append(needles[k])
            k += 1
        if i < len(lines):
            ordered.append((lines[i], None))
    out: list[Piece] = []
    for j, piece in enumerate(ordered):
        if j:
            out.append((sep, None))
        out.append(piece)
    return out


def needle_depths(rng: random.Random, count: int) -> list[float]:
    """Sorted depths in percent: distinct points of RULER's 40-point grid when they suffice."""
    if count <= len(DEPTHS):
        return sorted(rng.sample(DEPTHS, count))
    return sorted(rng.uniform(0, 100) for _ in range(count))


def _fitter(tokenizer: Any, target_length: int) -> Callable[..., tuple[int, Draft]]:
    def measure(draft: Draft) -> int:
        return max(count_tokens(tokenizer, draft.context + q) for q in draft.questions)

    def fit(build: Callable[[int], Draft], minimum: int = 0) -> tuple[int, Draft]:
        return fit_largest(build, measure, target_length, minimum)

    return fit


def _session(task: str, draft: Draft, tokenizer: Any, target_length: int, seed: int, index: int) -> Session:
    context = draft.context
    needles = []
    offset = 0
    for text, info in draft.pieces:
        if info is not None:
            start, end = offset, offset + len(text)
            # Token spans index encode(context) (no special tokens); a needle's span
            # starts at the token holding its leading space.
            token_start = count_tokens(tokenizer, context[:start].rstrip(" "))
            token_end = count_tokens(tokenizer, context[:end])
            needles.append({**info, "text": text, "char_span": [start, end], "token_span": [token_start, token_end]})
        offset += len(text)
    metadata = {
        "task": task,
        "seed": seed,
        "index": index,
        "target_length": target_length,
        "context_length": count_tokens(tokenizer, context),
        "lengths": [count_tokens(tokenizer, context + q) for q in draft.questions],
        "answer_prefixes": list(draft.prefixes),
        "needles": needles,
        **draft.info,
    }
    turns = [Turn(q, a) for q, a in zip(draft.questions, draft.answers)]
    return Session(task, context, turns, metadata)


# ---------------------------------------------------------------- needle in a haystack

NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_INTRO = (
    "Some special magic {kind} are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {kind} afterwards.\n"
)
NIAH_INTRO_ONE = (
    "A special magic {kind} is hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {kind} afterwards.\n"
)
NIAH_QUESTION = "What are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_QUESTION_ONE = "What is the special magic {kind} for {query} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
NIAH_ANSWER_PREFIX_ONE = " The special magic {kind} for {query} mentioned in the provided text is"


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def niah(
    target_length: int,
    seed: int = 0,
    index: int = 0,
    tokenizer: Any = None,
    num_questions: int = 1,
    *,
    task: str,
    haystack: str,
    key_type: str,
    value_type: str,
    num_keys: int,
    num_values: int,
    num_queries: int,
) -> Session:
    """RULER's needle in a haystack (scripts/data/synthetic/niah.py).

    ``num_keys`` needles "One of the special magic {values} for {key} is: {value}."
    (``num_values`` per key) sit at depths drawn from a 40-point grid in a haystack
    that is ``noise`` (a repeated block of short sentences, one block per line),
    ``essay`` (generated prose) or ``needle`` (every line a needle with a random
    key and value, as RULER's multikey_2/3). The question asks for the values of
    ``num_queries`` keys; the answers are all their values (string_match_all).
    Singular wording ("A special magic number ... is") when one value is asked for.
    Session mode: ``num_queries`` different keys per question, so the context holds
    max(num_keys, num_queries * num_questions) keys.
    """
    tokenizer = tokenizer or default_tokenizer()
    rng = rng_for(task, target_length, seed, index)
    total_keys = max(num_keys, num_queries * num_questions)
    keys = distinct_items(rng, key_type, total_keys)
    flat_values = distinct_items(rng, value_type, total_keys * num_values, exclude=set(keys))
    values = [flat_values[k * num_values : (k + 1) * num_values] for k in range(total_keys)]

    asked = rng.sample(range(total_keys), num_queries * num_questions)
    asked_by = [asked[q * num_queries : (q + 1) * num_queries] for q in range(num_questions)]
    question_of = {k: q for q, ks in enumerate(asked_by) for k in ks}

    needles: list[Piece] = [
        (NIAH_NEEDLE.format(kind=value_type, key=keys[k], value=v),
         {"key": keys[k], "value": v, "queried": k in question_of, "questions": [question_of[k]] if k in question_of else []})
        for k in range(total_keys)
        for v in values[k]
    ]
    rng.shuffle(needles)
    depths = needle_depths(rng, len(needles))
    for (_, info), depth in zip(needles, depths):
        info["depth"] = depth

    one = num_queries * num_values == 1
    kind = value_type[:-1] if one else value_type
    intro = (NIAH_INTRO_ONE if one else NIAH_INTRO).format(kind=kind)
    questions, answers, prefixes = [], [], []
    for ks in asked_by:
        query = _join_keys([keys[k] for k in ks])
        prefixes.append((NIAH_ANSWER_PREFIX_ONE if one else NIAH_ANSWER_PREFIX).format(kind=kind, query=query))
        questions.append((NIAH_QUESTION_ONE if one else NIAH_QUESTION).format(kind=kind, query=query) + prefixes[-1])
        answers.append([v for k in ks for v in values[k]])

    exclude = set(keys) | set(flat_values)
    info = {"haystack": haystack, "key_type": key_type, "value_type": value_type,
            "num_keys": total_keys, "num_values": num_values, "num_queries": num_queries}
    fit = _fitter(tokenizer, target_length)

    def draft(lines: list[str], sep: str, **extra: Any) -> Draft:
        pieces = [(intro, None)] + weave(lines, needles, depths, sep) + [("\n", None)]
        return Draft(pieces, questions, answers, prefixes, {**info, **extra})

    if haystack == "essay":
        essay = EssayStream(rng_for(task, target_length, seed, index, "filler"), exclude)
        _, best = fit(lambda n: draft(essay.take(n), " ", filler_words=n))
    elif haystack == "noise":
        _, best = fit(lambda n: draft(noise_lines(n), "\n", filler_words=n))
    elif haystack == "needle":
        distractor_keys = ItemStream(rng_for(task, target_length, seed, index, "keys"), key_type, exclude)
        distractor_values = ItemStream(rng_for(task, target_length, seed, index, "values"), value_type, exclude)
        pad = EssayStream(rng_for(task, target_length, seed, index, "pad"), exclude)
        pad_depth = rng.random()

        def needle_lines(n: int, pad_words: int) -> list[str]:
            lines = [NIAH_NEEDLE.format(kind=value_type, key=k, value=v)
                     for k, v in zip(distractor_keys.take(n), distractor_values.take(n))]
            if pad_words:  # less than one needle of filler words, to land on the length
                lines.insert(int(pad_depth * (n + 1)), " ".join(pad.take(pad_words)))
            return lines

        n, _ = fit(lambda n: draft(needle_lines(n, 0), "\n", distractor_needles=n, filler_words=0))
        _, best = fit(lambda m: draft(needle_lines(n, m), "\n", distractor_needles=n, filler_words=m))
    else:
        raise ValueError(f"unknown haystack {haystack!r}; valid: noise, essay, needle")
    return _session(task, best, tokenizer, target_length, seed, index)


# ---------------------------------------------------------------- variable tracking

VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num} variables are assigned the value {value}, they are: "
)
VT_FIRST = "Variable {name} equal {value}."  # RULER: "VAR {name} = {value}"
VT_HOP = "Variable {name} equal variable {previous}."  # RULER: "VAR {name} = VAR {previous}"
VT_EXAMPLE_TOKENS = 500  # RULER fits its in-context example into 500 tokens


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, exclude: set[str]) -> tuple[list[list[str]], list[str], list[list[str]]]:
    names = distinct_items(rng, "words", num_chains * (num_hops + 1), exclude=exclude)
    chain_names = [names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)] for c in range(num_chains)]
    chain_values: list[str] = []
    while len(chain_values) < num_chains:
        value = random_number(rng, 5)  # RULER: np.random.randint(10000, 99999)
        if value not in chain_values:
            chain_values.append(value)
    lines = [
        [VT_FIRST.format(name=ns[0], value=v)] + [VT_HOP.format(name=ns[j + 1], previous=ns[j]) for j in range(num_hops)]
        for ns, v in zip(chain_names, chain_values)
    ]
    return chain_names, chain_values, lines


def vt(
    target_length: int,
    seed: int = 0,
    index: int = 0,
    tokenizer: Any = None,
    num_questions: int = 1,
    *,
    task: str = "vt",
    num_chains: int = 1,
    num_hops: int = 4,
) -> Session:
    """RULER's variable tracking (scripts/data/synthetic/variable_tracking.py; vt:
    noise haystack, num_chains 1, num_hops 4).

    A chain "VAR X1 = 12345", "VAR X2 = VAR X1", ... (num_hops + 1 variables, 5-digit
    value; here "Variable river-salt equal 12345.", "Variable dark-fox equal variable
    river-salt.") is scattered in order through the noise haystack, one per line;
    the question asks for every variable assigned the value, answers are all
    num_hops + 1 names (string_match_all). As in RULER one solved example (1 chain,
    its own names) precedes the task, fitted to min(500, target / 8) tokens; it is
    left out when even its bare chain does not fit that. Session mode: one chain per
    question.
    """
    tokenizer = tokenizer or default_tokenizer()
    rng = rng_for(task, target_length, seed, index)
    chains = max(num_chains, num_questions)
    chain_names, chain_values, chain_lines = _vt_chains(rng, chains, num_hops, set())
    used = {n for ns in chain_names for n in ns}

    # The in-context example: a complete solved instance with its own chain.
    example_names, example_values, example_lines = _vt_chains(rng, 1, num_hops, used)
    example_needles: list[Piece] = [(line, None) for line in example_lines[0]]
    example_depths = needle_depths(rng, len(example_needles))
    example_answer = VT_ANSWER_PREFIX.format(num=num_hops + 1, value=example_values[0]) + " ".join(example_names[0])

    def example(n: int) -> Draft:
        pieces = [(VT_INTRO, None)] + weave(noise_lines(n), example_needles, example_depths, "\n")
        text = "".join(t for t, _ in pieces) + "\n" + VT_QUESTION.format(value=example_values[0]) + example_answer + "\n"
        return Draft([(text, None)], [""], [[]], [""])

    example_text = ""
    try:
        _, best_example = fit_largest(example, lambda d: count_tokens(tokenizer, d.context),
                                      min(VT_EXAMPLE_TOKENS, target_length // 8))
        example_text = best_example.context
    except ValueError:
        pass

    needles: list[Piece] = []
    depths: list[float] = []
    for c in range(chains):
        for j, (line, depth) in enumerate(zip(chain_lines[c], needle_depths(rng, num_hops + 1))):
            needles.append((line, {"chain": c, "hop": j, "depth": depth, "questions": [c] if c < num_questions else []}))
            depths.append(depth)
    order = sorted(range(len(needles)), key=lambda i: (depths[i], needles[i][1]["hop"]))
    needles = [needles[i] for i in order]
    depths = [depths[i] for i in order]

    prefixes = [VT_ANSWER_PREFIX.format(num=num_hops + 1, value=chain_values[q]) for q in range(num_questions)]
    questions = [VT_QUESTION.format(value=chain_values[q]) + prefixes[q] for q in range(num_questions)]
    answers = [list(chain_names[q]) for q in range(num_questions)]
    info = {"haystack": "noise", "num_chains": chains, "num_hops": num_hops, "fewshot": bool(example_text)}

    def draft(n: int) -> Draft:
        pieces = [(example_text, None), (VT_INTRO, None)] + weave(noise_lines(n), needles, depths, "\n") + [("\n", None)]
        return Draft(pieces, questions, answers, prefixes, {**info, "filler_words": n})

    _, best = _fitter(tokenizer, target_length)(draft)
    return _session(task, best, tokenizer, target_length, seed, index)


# ---------------------------------------------------------------- common words extraction

CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = "Question: What are the {num} most common words in the above list?"
CWE_ANSWER_PREFIX = " Answer: The top {num} words that appear most often in the list are:"
# RULER: at 4K tokens and above, 30 repeats of each common word and 3 of the others,
# after one example list (40 words, 10 x10, the rest x3); below 4K, 6 and 1 after a
# (20 words, x3, x1) example. Ours, below what that fits with at least as many
# uncommon words as common ones: 3 and 1, no example, at least one uncommon word.
CWE_SETTINGS = (
    {"min_length": 4096, "freq_common": 30, "freq_uncommon": 3, "example": (40, 10, 3), "min_uncommon": 10},
    {"min_length": 0, "freq_common": 6, "freq_uncommon": 1, "example": (20, 3, 1), "min_uncommon": 10},
    {"min_length": 0, "freq_common": 3, "freq_uncommon": 1, "example": None, "min_uncommon": 1},
)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def cwe(
    target_length: int,
    seed: int = 0,
    index: int = 0,
    tokenizer: Any = None,
    num_questions: int = 1,
    *,
    task: str = "cwe",
    num_common: int = 10,
) -> Session:
    """RULER's common words extraction (scripts/data/synthetic/common_words_extraction.py;
    cwe: freq_cw 30, freq_ucw 3, num_cw 10).

    A numbered list where ``num_common`` words repeat ``freq_common`` times and every
    other word ``freq_uncommon`` times, shuffled; answers are the common words
    (string_match_all). Words are filler compounds. The length sets the number of
    uncommon words; the setting is the first of CWE_SETTINGS whose minimum length is
    met and whose minimum number of uncommon words fits.
    """
    if num_questions != 1:
        raise ValueError("cwe asks one question per context; sessions need a retrieval or QA task")
    tokenizer = tokenizer or default_tokenizer()
    words = ItemStream(rng_for(task, target_length, seed, index, "words"), "words")
    prefix = CWE_ANSWER_PREFIX.format(num=num_common)
    question = CWE_QUESTION.format(num=num_common) + prefix
    fit = _fitter(tokenizer, target_length)

    for setting in CWE_SETTINGS:
        if target_length < setting["min_length"]:
            continue
        example_text, skip = "", 0
        if setting["example"] is not None:
            size, f_common, f_uncommon = setting["example"]
            chosen = words.take(size)
            listed = chosen[:num_common] * f_common + chosen[num_common:] * f_uncommon
            rng_for(task, target_length, seed, index, "example").shuffle(listed)
            example_text = (CWE_INTRO + _numbered(listed) + "\n" + question + " " + _numbered(chosen[:num_common]) + "\n")
            skip = size

        def draft(n: int) -> Draft:
            chosen = words.take(skip + num_common + n)[skip:]
            common = chosen[:num_common]
            listed = common * setting["freq_common"] + chosen[num_common:] * setting["freq_uncommon"]
            rng_for(task, target_length, seed, index, "order", n).shuffle(listed)
            pieces = [(example_text, None), (CWE_INTRO + _numbered(listed) + "\n", None)]
            info = {"fewshot": bool(example_text), "freq_common": setting["freq_common"],
                    "freq_uncommon": setting["freq_uncommon"], "num_common": num_common,
                    "num_uncommon": n}
            return Draft(pieces, [question], [list(common)], [prefix], info)

        try:
            _, best = fit(draft, minimum=setting["min_uncommon"])
        except ValueError:
            continue
        return _session(task, best, tokenizer, target_length, seed, index)
    raise ValueError(f"target of {target_length} tokens is too small for {task}")


# ---------------------------------------------------------------- frequent words extraction

FWE_INTRO = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_MIN_WORDS = 60  # below this the counts of ranks 4 and 5 can tie


def _zeta(alpha: float, terms: int = 10000) -> float:
    return sum(k**-alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1)


def fwe(
    target_length: int,
    seed: int = 0,
    index: int = 0,
    tokenizer: Any = None,
    num_questions: int = 1,
    *,
    task: str = "fwe",
    alpha: float = 2.0,
) -> Session:
    """RULER's frequent words extraction (scripts/data/synthetic/freq_words_extraction.py;
    fwe: alpha 2.0).

    A vocabulary of (length - 50) // 50 coded words, word of rank k appearing
    floor(n * k^-alpha / zeta(alpha)) times, shuffled; the top-ranked word is the
    noise '...', and the answers are ranks 2-4 (string_match_all). Coded words are
    filler compounds; n is fitted to the length.
    """
    if num_questions != 1:
        raise ValueError("fwe asks one question per context; sessions need a retrieval or QA task")
    tokenizer = tokenizer or default_tokenizer()
    vocab_size = max(5, (target_length - 50) // 50)  # RULER: (max_seq_length - tokens_to_generate) // 50
    vocab = ["..."] + ItemStream(rng_for(task, target_length, seed, index, "words"), "words").take(vocab_size - 1)
    weights = [k**-alpha / _zeta(alpha) for k in range(1, vocab_size + 1)]
    question = FWE_QUESTION + FWE_ANSWER_PREFIX

    def draft(n: int) -> Draft:
        counts = [int(n * w) for w in weights]
        text = [word for word, c in zip(vocab, counts) for _ in range(c)]
        rng_for(task, target_length, seed, index, "order", n).shuffle(text)
        info = {"alpha": alpha, "vocab_size": vocab_size, "num_words": n, "counts": counts[:5]}
        return Draft([(FWE_INTRO + " ".join(text) + "\n", None)], [question], [vocab[1:4]], [FWE_ANSWER_PREFIX], info)

    _, best = _fitter(tokenizer, target_length)(draft, minimum=FWE_MIN_WORDS)
    return _session(task, best, tokenizer, target_length, seed, index)


# ---------------------------------------------------------------- question answering

QA_INSTRUCTION = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
QA_HEAD = QA_INSTRUCTION + "\n\nThe following are given documents.\n\n"
QA_DOCUMENT = "Document {i}:\n"  # RULER's DOCUMENT_PROMPT "Document {i}:\n{document}"
QA_QUESTION = QA_INSTRUCTION + "\n\nQuestion: {query}"
QA_ANSWER_PREFIX = " Answer:"
# Facts every document states about its entity: relation -> (fact, values, question).
# Facts (the needles) use filler words only; questions may use any words.
QA_RELATIONS = {
    "house": ("The house of {e} is {v}.", COLORS, "What color is the house of {e}?"),
    "forest": ("The forest of {e} has the {v}.", ANIMALS, "Which animal lives in the forest of {e}?"),
    "market": ("The market of {e} has {v}.", FOODS, "Which food does the market of {e} sell?"),
    "number": ("The number of {e} is {v}.", None, "What is the number of {e}?"),  # 4 digits
}
QA_CITY = "The city of {e} is {v}."  # the bridge of two-hop questions
QA_DOC_WORDS = 20  # filler words in a document before the length fit adds more


def qa(
    target_length: int,
    seed: int = 0,
    index: int = 0,
    tokenizer: Any = None,
    num_questions: int = 1,
    *,
    task: str,
    hops: int,
) -> Session:
    """RULER's QA (scripts/data/synthetic/qa.py): qa_1 on SQuAD (the question's
    paragraph among distractor paragraphs), qa_2 on HotpotQA (a question needing two
    documents), scored with string_match_part. Documents here are generated.

    Each document "Document i:\\n{entity}\\n{text}" states five facts about its entity
    among filler sentences: "The house of E is red.", "The forest of E has the fox.",
    "The market of E has honey.", "The number of E is 4821." and "The city of E is F."
    (F another document's entity). hops=1: "What color is the house of E?"; hops=2
    (bridge): "What color is the house of the city of E?", whose answer differs from
    E's own. The length sets the number of documents, then the filler words spread
    over them. Session mode: each question about a different entity.
    """
    tokenizer = tokenizer or default_tokenizer()
    names = ItemStream(rng_for(task, target_length, seed, index, "names"), "words")

    def facts_of(i: int) -> dict[str, Any]:
        r = rng_for(task, target_length, seed, index, "doc", i)
        facts = {rel: (r.choice(pool) if pool else random_number(r, 4)) for rel, (_, pool, _) in QA_RELATIONS.items()}
        facts["city"] = r.randrange(i) if i else 1  # an earlier document (the first points at the second)
        facts["order"] = r.sample(list(QA_RELATIONS) + ["city"], len(QA_RELATIONS) + 1)
        return facts

    rng = rng_for(task, target_length, seed, index)
    questions, answers = [], []
    gold: dict[tuple[int, str], list[int]] = {}  # (document, relation) -> the questions it answers
    for q in range(num_questions):
        e = facts_of(q)
        if hops == 1:
            rel = rng.choice(list(QA_RELATIONS))
            query = QA_RELATIONS[rel][2].format(e=names.take(q + 1)[q])
            answers.append([e[rel]])
            gold.setdefault((q, rel), []).append(q)
        else:
            city = facts_of(e["city"])
            rels = [r for r in QA_RELATIONS if e[r] != city[r]] or list(QA_RELATIONS)
            # in a session, prefer a fact of the city no earlier question asks for
            rels = [r for r in rels if (e["city"], r) not in gold] or rels
            rel = rng.choice(rels)
            query = QA_RELATIONS[rel][2].format(e="the city of " + names.take(q + 1)[q])
            answers.append([city[rel]])
            gold.setdefault((q, "city"), []).append(q)
            gold.setdefault((e["city"], rel), []).append(q)
        questions.append(QA_QUESTION.format(query=query) + QA_ANSWER_PREFIX)

    def document(i: int, filler_words: int) -> list[Piece]:
        f, name = facts_of(i), names.take(i + 1)[i]
        sentences: list[Piece] = []
        for rel in f["order"]:
            if rel == "city":
                text = QA_CITY.format(e=name, v=names.take(f["city"] + 1)[f["city"]])
            else:
                text = QA_RELATIONS[rel][0].format(e=name, v=f[rel])
            asked = gold.get((i, rel))
            role = "bridge" if rel == "city" else "answer"
            sentences.append((text, None if asked is None else {"questions": asked, "role": role, "document": i}))
        filler = EssayStream(rng_for(task, target_length, seed, index, "doc-filler", i)).take(filler_words)
        depths = [100 * (j + 1) / (len(sentences) + 1) for j in range(len(sentences))]
        return [(name + "\n", None)] + weave(filler, sentences, depths, " ")

    fit = _fitter(tokenizer, target_length)
    info = {"hops": hops}

    def draft(n: int, extra_words: int, base_words: int) -> Draft:
        order = list(range(n))
        rng_for(task, target_length, seed, index, "order", n).shuffle(order)
        pieces: list[Piece] = [(QA_HEAD, None)]
        for slot, i in enumerate(order):
            words = base_words + extra_words // n + (1 if i < extra_words % n else 0)
            if slot:
                pieces.append(("\n\n", None))
            pieces.append((QA_DOCUMENT.format(i=slot + 1), None))
            pieces.extend(document(i, words))
        pieces.append(("\n\n", None))
        return Draft(pieces, questions, answers, [QA_ANSWER_PREFIX] * len(questions),
                     {**info, "num_documents": n, "extra_filler_words": extra_words})

    minimum = max(2, num_questions)
    base_words = QA_DOC_WORDS
    try:
        n, _ = fit(lambda n: draft(n, 0, base_words), minimum=minimum)
    except ValueError:  # short targets: bare documents, the filler comes in the second fit
        base_words = 0
        n, _ = fit(lambda n: draft(n, 0, base_words), minimum=minimum)
    _, best = fit(lambda m: draft(n, m, base_words))
    return _session(task, best, tokenizer, target_length, seed, index)


# ---------------------------------------------------------------- registry

TaskGenerator = Callable[..., Session]

TASKS: dict[str, TaskGenerator] = {
    "niah_single_1": functools.partial(niah, task="niah_single_1", haystack="noise", key_type="words", value_type="numbers", num_keys=1, num_values=1, num_queries=1),
    "niah_single_2": functools.partial(niah, task="niah_single_2", haystack="essay", key_type="words", value_type="numbers", num_keys=1, num_values=1, num_queries=1),
    "niah_single_3": functools.partial(niah, task="niah_single_3", haystack="essay", key_type="words", value_type="uuids", num_keys=1, num_values=1, num_queries=1),
    "niah_multikey_1": functools.partial(niah, task="niah_multikey_1", haystack="essay", key_type="words", value_type="numbers", num_keys=4, num_values=1, num_queries=1),
    "niah_multikey_2": functools.partial(niah, task="niah_multikey_2", haystack="needle", key_type="words", value_type="numbers", num_keys=1, num_values=1, num_queries=1),
    "niah_multikey_3": functools.partial(niah, task="niah_multikey_3", haystack="needle", key_type="uuids", value_type="uuids", num_keys=1, num_values=1, num_queries=1),
    "niah_multivalue": functools.partial(niah, task="niah_multivalue", haystack="essay", key_type="words", value_type="numbers", num_keys=1, num_values=4, num_queries=1),
    "niah_multiquery": functools.partial(niah, task="niah_multiquery", haystack="essay", key_type="words", value_type="numbers", num_keys=4, num_values=1, num_queries=4),
    "vt": functools.partial(vt, task="vt", num_chains=1, num_hops=4),
    "cwe": functools.partial(cwe, task="cwe", num_common=10),
    "fwe": functools.partial(fwe, task="fwe", alpha=2.0),
    "qa_1": functools.partial(qa, task="qa_1", hops=1),
    "qa_2": functools.partial(qa, task="qa_2", hops=2),
}
# Tasks whose context can carry several questions (SCBench-style sessions).
SESSION_TASKS = tuple(name for name in TASKS if name not in ("cwe", "fwe"))


def generate_session(task: str, target_length: int, num_questions: int = 4, seed: int = 0, index: int = 0, tokenizer: Any = None) -> Session:
    """One shared context and ``num_questions`` questions about it; every
    ``context + question`` fits the target (within 2%)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    return TASKS[task](target_length, seed, index, tokenizer, num_questions)


def generate_sample(task: str, target_length: int, seed: int = 0, index: int = 0, tokenizer: Any = None) -> Sample:
    """Sample ``index`` of ``task`` at ``target_length`` tokens for ``seed``."""
    return generate_session(task, target_length, 1, seed, index, tokenizer).sample(0)


def generate_samples(task: str, target_length: int, num_samples: int, seed: int = 0, tokenizer: Any = None) -> list[Sample]:
    tokenizer = tokenizer or default_tokenizer()
    return [generate_sample(task, target_length, seed, i, tokenizer) for i in range(num_samples)]
