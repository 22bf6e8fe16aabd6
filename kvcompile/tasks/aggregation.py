"""RULER's tasks that need more than one lookup: variable tracking (follow a chain of assignments hidden in filler)
and common-words extraction (count words in a long list). Generated locally; scored by exact match of every
expected value."""

from __future__ import annotations

import random
import re
import string

from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.corpus import Corpus
from kvcompile.tasks.needles import render_prompt
from kvcompile.tasks.passkey import FILLER
from kvcompile.tasks.retrieval import TaskPrompt, insert_sentences

CHAIN_HOPS = 2  # VAR B = VAR A, VAR C = VAR B: three names to find
COMMON_WORDS = 3


def variable_tracking_prompt(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, chat: bool = True
) -> TaskPrompt:
    """A chain `VAR A = 12345`, `VAR B = VAR A`, ... in repeated filler, the first assignment at `depth` and the
    others spread after it; asks for every variable that holds the value."""
    rng = random.Random(f"variable_tracking:{seed}:{length}:{depth}")
    value = str(rng.randint(10000, 99999))
    names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(CHAIN_HOPS + 1)]
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    question = (
        f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain of variable assignments in the text above, {len(names)} variables are "
        f"assigned the value {value}, they are:"
    )
    overhead = len(tokenizer(" ".join(statements) + question).input_ids) + 24
    filler_tokens = len(tokenizer(FILLER).input_ids)
    context = FILLER * max(1, (length - overhead) // filler_tokens)
    spread = [depth + (1.0 - depth) * 0.9 * i / len(statements) for i in range(len(statements))]
    context = insert_sentences(context, list(zip(spread, statements)))
    return _prompt("variable_tracking", tokenizer, context, question, tuple(names), length, depth, chat)


def common_words_prompt(
    corpus: Corpus, tokenizer: PreTrainedTokenizerBase, length: int, seed: int, chat: bool = True
) -> TaskPrompt:
    """A numbered list of words (from the held-out book's vocabulary) in which a few words recur far more often
    than the others; asks for the most common ones."""
    rng = random.Random(f"common_words:{seed}:{length}")
    vocabulary = sorted({w.lower() for d in corpus.documents for w in re.findall(r"\b[a-zA-Z]{5,9}\b(?!')", d)})
    words = rng.sample(vocabulary, min(len(vocabulary), 1000))
    common, rare = words[:COMMON_WORDS], words[COMMON_WORDS:]
    question = (
        f"\n\nQuestion: What are the {COMMON_WORDS} most common words in the above list? "
        f"Answer: The top {COMMON_WORDS} words that appear most often in the list are:"
    )
    numbered = lambda words: " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))  # noqa: E731
    room = length - len(tokenizer(question).input_ids) - 60
    entries = int(room / (len(tokenizer(numbered(rare[:200])).input_ids) / 200))
    for _ in range(2):  # list numbers grow longer with the list: measure once more at the estimated size
        repeats = max(3, entries // (3 * COMMON_WORDS))  # the common words fill about a third of the list
        rare_count = min(len(rare), max(1, (entries - repeats * COMMON_WORDS) // 2))
        listed = common * repeats + rare[:rare_count] * 2
        entries = int(len(listed) * room / len(tokenizer(numbered(listed)).input_ids))
    rng.shuffle(listed)
    context = (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n"
        + numbered(listed)
    )
    return _prompt("common_words", tokenizer, context, question, tuple(common), length, None, chat)


def _prompt(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    expected: tuple[str, ...],
    length: int,
    depth: float | None,
    chat: bool,
) -> TaskPrompt:
    # Raw text needs no answer cue: the question ends in RULER's answer prefix.
    prompt = render_prompt(tokenizer, context + question, chat=True) if chat else context + question
    return TaskPrompt(task, prompt, expected, length, depth, prompt.index(question))
