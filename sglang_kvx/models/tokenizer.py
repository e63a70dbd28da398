"""The demo models' tokenizer, built offline and deterministically.

A byte-level BPE with a 512-entry vocabulary, trained on text generated here
from a fixed word list, so every later piece of text (documents, needles,
numbers, questions) tokenizes without unknown tokens and without a download.
"""

from __future__ import annotations

import random
from pathlib import Path

VOCAB_SIZE = 512
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT]

# A plain chat layout: one role marker per turn, the answer follows the
# assistant marker. Used by /v1/chat/completions.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

WORDS = (
    "the a an of to and in is it that for on was with as by at from this be are or not "
    "have has had one two three four five six seven eight nine ten hundred thousand "
    "key value number word special magic needle question answer what which who where "
    "when why how find list all some many most few first last next previous after before "
    "document section chapter page line text story report note memory context cache "
    "city river mountain forest garden house road bridge market school library museum "
    "red blue green yellow black white orange purple gray brown "
    "cat dog bird fish horse tiger lion bear wolf fox "
    "apple bread cheese honey lemon olive pepper rice salt sugar "
    "run walk read write speak listen think remember forget keep store "
    "small large long short early late quick slow bright dark "
    "variable assign equal copy repeat count frequent common rare hidden "
    "system user assistant please tell me give return only"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.5:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        if rng.random() < 0.3:
            words.append(f"{rng.choice(WORDS)}-{rng.choice(WORDS)}")
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "?", ":", ","]))
    return lines


def build_tokenizer(out_dir: str | Path, seed: int = 0) -> Path:
    """Train the byte-level BPE and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(20000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=65536,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out
