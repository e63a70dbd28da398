"""The offline evaluation suite: RULER-shaped generators, length control, scoring, sessions (no server)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from sglang_kvx.eval import (
    METRICS,
    SESSION_TASKS,
    TASKS,
    count_tokens,
    default_tokenizer,
    encode,
    generate_sample,
    generate_session,
    metric_table,
    score_samples,
    score_task,
    string_match_all,
    string_match_part,
)
from sglang_kvx.eval.length import fit_largest
from sglang_kvx.eval.vocab import EssayStream, rng_for
from sglang_kvx.models.tokenizer import WORDS

RULER_TASKS = [
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
]
NIAH = [t for t in RULER_TASKS if t.startswith("niah")]
RETRIEVAL = NIAH + ["vt", "qa_1", "qa_2"]
LENGTHS = (512, 2048)


@functools.cache
def tok():
    return default_tokenizer()


@functools.cache
def sample(task: str, length: int = 512, seed: int = 0, index: int = 0):
    return generate_sample(task, length, seed=seed, index=index, tokenizer=tok())


def as_record(s) -> str:
    return json.dumps([s.task, s.context, s.question, s.answers, s.metadata], sort_keys=True)


def test_registry_holds_rulers_thirteen_tasks_with_rulers_metrics():
    assert list(TASKS) == RULER_TASKS
    for task in RULER_TASKS:
        assert METRICS[task] is (string_match_part if task.startswith("qa") else string_match_all)


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("task", RULER_TASKS)
def test_same_seed_same_sample_other_seed_or_index_another(task):
    first = sample(task)
    again = generate_sample(task, 512, seed=0, index=0, tokenizer=tok())
    assert as_record(again) == as_record(first)
    for other in (sample(task, seed=1), sample(task, index=1)):
        assert other.context != first.context
        assert other.answers != first.answers


def test_samples_do_not_depend_on_the_process_hash_seed():
    code = (
        "import json; from sglang_kvx.eval import generate_sample;"
        "s = [generate_sample(t, 512, seed=5, index=2) for t in ('niah_multikey_3', 'vt', 'qa_2')];"
        "print(json.dumps([[x.context, x.question, x.answers, x.metadata] for x in s], sort_keys=True))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    here = [generate_sample(t, 512, seed=5, index=2, tokenizer=tok()) for t in ("niah_multikey_3", "vt", "qa_2")]
    assert json.loads(out) == json.loads(json.dumps([[x.context, x.question, x.answers, x.metadata] for x in here], sort_keys=True))


# ---------------------------------------------------------------- length control


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", RULER_TASKS)
def test_prompt_is_within_two_percent_below_the_target(task, length):
    s = sample(task, length)
    tokens = count_tokens(tok(), s.context + s.question)
    assert 0.98 * length <= tokens <= length
    assert s.metadata["length"] == tokens
    assert s.metadata["context_length"] == count_tokens(tok(), s.context)
    assert s.metadata["target_length"] == length and s.metadata["task"] == task


class CharTokenizer:
    """One token per character: the generators must fit any tokenizer, not just the demo one."""

    def encode(self, text):
        return [ord(c) for c in text]


class CallableTokenizer:
    """Only __call__, returning a dict, as some tokenizers do."""

    def __call__(self, text):
        return {"input_ids": text.split()}


@pytest.mark.parametrize("tokenizer", [CharTokenizer(), CallableTokenizer()], ids=["chars", "call"])
@pytest.mark.parametrize("task", ["niah_multikey_2", "vt", "cwe", "qa_2"])
def test_length_control_works_with_other_tokenizers(task, tokenizer):
    length = 3000 if isinstance(tokenizer, CharTokenizer) else 1000
    s = generate_sample(task, length, tokenizer=tokenizer)
    assert 0.98 * length <= len(encode(tokenizer, s.context + s.question)) <= length


def test_fit_largest_finds_the_largest_fitting_size_and_refuses_too_small_targets():
    size, built = fit_largest(lambda n: n, lambda n: 3 * n + 10, target=1000)
    assert size == 330 and built == 330
    with pytest.raises(ValueError, match="too small"):
        fit_largest(lambda n: n, lambda n: 3 * n + 10, target=1000, minimum=400)
    with pytest.raises(ValueError, match="too small"):
        generate_sample("qa_2", 64, tokenizer=tok())


# ---------------------------------------------------------------- task content


def needle_texts(s) -> list[str]:
    return [n["text"] for n in s.metadata["needles"]]


@pytest.mark.parametrize("task", RETRIEVAL)
def test_answers_are_stated_in_the_context_by_a_recorded_needle(task):
    s = sample(task, 2048)
    needles = s.metadata["needles"]
    assert needles
    for n in needles:
        start, end = n["char_span"]
        assert s.context[start:end] == n["text"]
    for answer in s.answers:
        assert answer in s.context
        assert any(answer in text for text in needle_texts(s)), answer


@pytest.mark.parametrize("task", RETRIEVAL)
def test_needle_token_spans_cover_the_needle_tokens(task):
    s = sample(task, 2048)
    ids = encode(tok(), s.context)
    for n in s.metadata["needles"]:
        start, end = n["token_span"]
        assert 0 <= start < end <= len(ids)
        assert tok().decode(ids[start:end]).strip() == n["text"]
        # no token to spare, but for the separating space a needle starts with
        assert tok().decode(ids[start : end - 1]).strip() != n["text"]
        assert tok().decode(ids[start + 1 : end]).strip() != n["text"] or tok().decode(ids[start : start + 1]).isspace()


@pytest.mark.parametrize("task", NIAH)
def test_niah_question_restates_the_needle_and_ends_with_the_answer_prefix(task):
    s = sample(task, 2048)
    queried = [n for n in s.metadata["needles"] if n["queried"]]
    values = [n["value"] for n in queried]
    assert sorted(values) == sorted(s.answers)
    one = len(s.answers) == 1
    for n in queried:
        assert n["text"].startswith("One of the special magic") and n["text"].endswith(f" for {n['key']} is: {n['value']}.")
        assert n["key"] in s.question
    assert s.question.endswith(s.metadata["answer_prefix"])
    assert s.metadata["answer_prefix"].endswith("mentioned in the provided text " + ("is" if one else "are"))
    expected_keys = {"niah_multikey_1": 4, "niah_multiquery": 4}.get(task, 1)
    assert s.metadata["num_keys"] == expected_keys and len(s.metadata["needles"]) == expected_keys * (4 if task == "niah_multivalue" else 1)
    assert len(s.answers) == (4 if task in ("niah_multivalue", "niah_multiquery") else 1)


def test_niah_haystack_kinds_follow_ruler():
    noise = sample("niah_single_1", 2048).context
    assert noise.count("The garden is green.") > 20  # a repeated block
    essay = sample("niah_single_2", 2048).context
    assert essay.count("The garden is green.") == 0 and "special magic number" in essay
    needles = sample("niah_multikey_2", 2048)
    lines = needles.context.strip().split("\n")[1:]
    needle_lines = [line for line in lines if line.startswith("One of the special magic numbers for ")]
    assert len(needle_lines) >= len(lines) - 1 >= 40  # every line a needle but at most one filler line
    assert re.fullmatch(r"[a-z]+-[a-z]+-\d{4}-[a-z]+-[a-z]+", sample("niah_multikey_3").answers[0])
    assert re.fullmatch(r"\d{7}", sample("niah_single_1").answers[0])


def test_vt_chain_is_in_order_and_answers_every_variable():
    s = sample("vt", 2048)
    names = s.answers
    assert len(names) == 5 and s.metadata["num_hops"] == 4
    value = re.search(r"assigned the value (\d{5})", s.question).group(1)
    starts = [s.context.index(f"Variable {names[0]} equal {value}.")]
    for previous, name in zip(names, names[1:]):
        starts.append(s.context.index(f"Variable {name} equal variable {previous}."))
    assert starts == sorted(starts)
    assert s.question.endswith(f"5 variables are assigned the value {value}, they are: ")
    example = sample("vt", 4096)
    assert example.metadata["fewshot"] and example.context.count("Memorize and track") == 2


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_answers_are_the_words_repeated_most(length):
    s = sample("cwe", length)
    task_list = s.context.split("Below is a numbered list of words.")[-1]
    counts = Counter(re.findall(r"\d+\. (\S+)", task_list))
    common = set(s.answers)
    assert len(common) == 10
    assert {counts[w] for w in common} == {s.metadata["freq_common"]}
    assert all(c == s.metadata["freq_uncommon"] for w, c in counts.items() if w not in common)
    assert s.metadata["num_uncommon"] >= (1 if length == 512 else 10)
    assert s.metadata["fewshot"] == (length == 2048)  # RULER's example fits 2048, not 512


@pytest.mark.parametrize("length", LENGTHS)
def test_fwe_answers_are_the_three_most_frequent_coded_words(length):
    s = sample("fwe", length)
    counts = Counter(s.context.split("coded words. ")[1].split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..."
    assert set(s.answers) == set(ranked[1:4])
    assert counts[ranked[3]] > counts[ranked[4]]  # no tie at the cut


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_needs_the_right_documents(task):
    s = sample(task, 2048)
    roles = {n["role"]: n for n in s.metadata["needles"]}
    assert s.metadata["num_documents"] >= 2
    assert s.answers[0] in roles["answer"]["text"]
    if task == "qa_2":
        bridge = roles["bridge"]["text"]  # "The city of E is F."
        entity, city = re.fullmatch(r"The city of (\S+) is (\S+)\.", bridge).groups()
        assert entity in s.question and city not in s.question
        assert f" of {city} " in roles["answer"]["text"]
    assert s.question.endswith("? Answer:")


# ---------------------------------------------------------------- shared vocabulary


def is_filler_word(part: str) -> bool:
    return part in WORDS or part.isdigit()


@functools.cache
def filler_token_ids() -> frozenset[int]:
    text = " ".join(EssayStream(rng_for("vocabulary reference")).take(20000))
    return frozenset(encode(tok(), text))


@pytest.mark.parametrize("task", RETRIEVAL)
def test_needles_share_the_filler_vocabulary(task):
    s = sample(task, 2048)
    for n in s.metadata["needles"]:
        for item in [n.get("key"), n.get("value")] + s.answers:
            if item:
                assert all(is_filler_word(part) for part in item.split("-")), item
        words = re.findall(r"[A-Za-z0-9]+", n["text"])
        plural_ok = {"numbers", "uuids"}  # RULER's needle says "special magic numbers"
        assert all(is_filler_word(w.lower()) or w in plural_ok for w in words), n["text"]
        assert set(encode(tok(), n["text"])) <= filler_token_ids(), n["text"]


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_1", "vt", "qa_1"])
def test_haystack_filler_is_made_of_the_word_list(task):
    s = sample(task, 2048)
    text = s.context
    for n in sorted(s.metadata["needles"], key=lambda n: -n["char_span"][0]):
        start, end = n["char_span"]
        text = text[:start] + text[end:]
    head = {"vt": "in the following text.\n\n", "qa_1": "given documents.\n\n"}.get(task, "afterwards.\n")
    body = text.split(head, 1)[1]
    words = [w for w in re.findall(r"[A-Za-z0-9]+", body) if w != "Document"]
    assert len(words) > 300
    assert all(is_filler_word(w.lower()) for w in words), sorted({w for w in words if not is_filler_word(w.lower())})


# ---------------------------------------------------------------- scoring


def test_string_match_all_is_the_recall_of_expected_strings_ignoring_case():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("RIVER-SALT and blue-cat", ["river-salt", "Blue-Cat"]) == 1.0
    assert string_match_all("nothing here", ["123"]) == 0.0


def test_string_match_part_is_the_best_single_match():
    assert string_match_part("It is Paris.", ["paris", "London"]) == 1.0
    assert string_match_part("It is Rome.", ["paris", "London"]) == 0.0


def test_task_scores_use_rulers_metric_per_task_and_rulers_rounding():
    preds, refs = ["blue and 12", "\x00 red\n", "nothing"], [["Blue", "12"], ["red", "green"], ["x"]]
    assert score_task("niah_multivalue", preds, refs) == round((1 + 0.5 + 0) / 3 * 100, 2) == 50.0
    assert score_task("qa_1", preds, refs) == round(2 / 3 * 100, 2) == 66.67
    with pytest.raises(ValueError):
        score_task("vt", ["a"], [])


def test_scored_samples_make_a_per_task_table():
    samples = [sample("niah_single_1"), sample("niah_single_1", index=1), sample("qa_1"), sample("qa_1", 2048)]
    predictions = [" " + samples[0].answers[0] + ".", "no idea", samples[2].answers[0].upper(), "none"]
    scores = score_samples(samples, predictions)
    assert scores == {"niah_single_1": {512: 50.0}, "qa_1": {512: 100.0, 2048: 0.0}}
    table = metric_table(scores).splitlines()
    assert table[0] == "| task | 512 | 2048 | avg |"
    assert table[2] == "| niah_single_1 | 50.00 |  | 50.00 |"
    assert table[3] == "| qa_1 | 100.00 | 0.00 | 50.00 |"
    assert table[4] == "| avg | 75.00 | 0.00 | 37.50 |"


# ---------------------------------------------------------------- shared-context sessions


@pytest.mark.parametrize("task", ["niah_multikey_1", "niah_multikey_2", "niah_multiquery", "vt", "qa_1", "qa_2"])
def test_a_session_asks_several_questions_about_one_context(task):
    length = 2048
    session = generate_session(task, length, num_questions=3, seed=7, tokenizer=tok())
    assert len(session.turns) == 3
    assert len({turn.question for turn in session.turns}) == 3
    lengths = [count_tokens(tok(), session.context + turn.question) for turn in session.turns]
    assert session.metadata["lengths"] == lengths
    assert max(lengths) <= length and max(lengths) >= 0.98 * length
    answer_sets = [tuple(turn.answers) for turn in session.turns]
    assert len(set(answer_sets)) == 3 or task == "qa_1"  # three qa_1 answers may share a color
    for i, (question, answers) in enumerate(session.turns):
        assert question.endswith(session.metadata["answer_prefixes"][i])
        own = [n["text"] for n in session.metadata["needles"] if i in n["questions"]]
        for answer in answers:
            assert any(answer in text for text in own)
        child = session.sample(i)
        assert child.context == session.context and child.prompt == session.context + question
        assert child.metadata["length"] == lengths[i]


def test_sessions_are_offered_for_retrieval_and_qa_but_not_for_single_question_tasks():
    assert set(SESSION_TASKS) == set(RETRIEVAL)
    with pytest.raises(ValueError, match="one question"):
        generate_session("cwe", 1024, num_questions=2, tokenizer=tok())
    with pytest.raises(ValueError, match="unknown task"):
        generate_session("niah_single_9", 1024, tokenizer=tok())


def test_every_question_of_a_long_session_keeps_its_evidence():
    session = generate_session("qa_2", 8192, num_questions=8, seed=3, tokenizer=tok())
    for i, (question, answers) in enumerate(session.turns):
        child = session.sample(i).metadata["needles"]
        roles = sorted(n["role"] for n in child)
        assert roles == ["answer", "bridge"]
        assert answers[0] in next(n["text"] for n in child if n["role"] == "answer")
