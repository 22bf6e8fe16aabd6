"""Held-out long-context retrieval prompts for measuring compressed generation (never used for calibration):
the pass key (RULER's), one needle, several key-value needles of which one is asked (RULER's multi-key NIAH), and
one key with several values, all asked (RULER's multi-value NIAH). Each of the first three comes on both haystacks,
the same keys at the same depths: Moby-Dick (`passkey_prose`, `needle`, `multikey`) and RULER's repeated filler
(`passkey`, `needle_filler`, `multikey_filler`).
Each prompt is scored by match: every expected value must appear in the generated text."""

from __future__ import annotations

import dataclasses
import random

from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.corpus import Corpus
from kvcompile.tasks.needles import QUESTION_TEMPLATE, Needle, haystack_text, needle_probe, render_prompt
from kvcompile.tasks.passkey import FILLER, passkey_prompt
from kvcompile.tasks.scoring import score_answer

EVALUATION_NEEDLES = (
    Needle(
        "The old clockmaker of Bremen hid his savings under a loose stone by the fireplace.",
        "Where did the old clockmaker of Bremen hide his savings?",
        "under a loose stone",
    ),
    Needle(
        "The blacksmith's daughter named her grey horse Thunder Moon after a winter storm.",
        "What did the blacksmith's daughter name her grey horse?",
        "Thunder Moon",
    ),
    Needle(
        "The favourite dessert of Admiral Quill was baked pears with cinnamon cream.",
        "What was the favourite dessert of Admiral Quill?",
        "baked pears",
    ),
)
MULTIKEY_KEYS = ("amber", "willow", "falcon", "quartz", "harbor", "meadow", "cobalt", "lantern")
TASKS = ("passkey", "passkey_prose", "needle", "needle_filler", "multikey", "multikey_filler")
# RULER's noise haystack as a one-document corpus, long enough for any prompt the positions allow.
FILLER_CORPUS = Corpus("filler", (FILLER * 20_000,))
# Depths of the other needles, relative to the asked (or first) one, wrapping around the context.
OTHER_NEEDLE_OFFSETS = (0.3, 0.55, 0.8)


@dataclasses.dataclass(frozen=True)
class TaskPrompt:
    task: str
    prompt: str
    expected: tuple[str, ...]
    length: int
    depth: float | None  # relative depth of the (first) inserted fact; None for tasks without one
    question_start: int  # character where the question begins: the context alone is prompt[:question_start]
    scoring: str = "all"  # how an answer is scored (`scoring.SCORINGS`): the built-in tasks ask for every value
    id: str | None = None  # a user's suite: the prompt's own id

    def score(self, generated: str) -> float:
        """The generated text's score in [0, 1] against the expected values (`score_answer`)."""
        return score_answer(generated, self.expected, self.scoring)

    @property
    def gold_text(self) -> str:
        """The expected answer as text: every value, joined by commas, where all are asked for; else the first."""
        return ", ".join(self.expected) if self.scoring == "all" else self.expected[0]


def retrieval_prompt(
    task: str,
    corpus: Corpus,
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    depth: float,
    seed: int,
    chat: bool = True,
) -> TaskPrompt:
    """One prompt of a retrieval task; `chat` renders the question turn through the model's chat template (the
    pass key is always raw text ending in its answer cue). A `_filler` task is its book task on the filler."""
    name = task
    if task.endswith("_filler"):
        corpus, task = FILLER_CORPUS, task.removesuffix("_filler")

    def magic_numbers(keys: list[str], values: list[str], asked: str, expected: list[str]) -> TaskPrompt:
        """Key-value needles in book text: the first at `depth`, the others at spread depths; asks "What is/are
        <asked>?"."""
        sentences = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        verb = "are" if len(expected) > 1 else "is"
        question = QUESTION_TEMPLATE.format(question=f"What {verb} {asked}?")
        needles = (Needle(sentences[0], "", values[0]),)
        base = needle_probe(corpus, tokenizer, length - 20 * len(keys), depth, 0, seed, chat=False, needles=needles)
        context = base.prompt[: base.prompt.index(QUESTION_TEMPLATE.split("{")[0])]
        others = [((depth + offset) % 1.0, sentence) for offset, sentence in zip(OTHER_NEEDLE_OFFSETS, sentences[1:])]
        prompt = render_prompt(tokenizer, insert_sentences(context, others) + question, chat)
        return TaskPrompt(name, prompt, tuple(expected), length, depth, question_start(prompt))

    if task == "passkey":
        prompt = passkey_prompt(tokenizer, length, depth, seed)
        return TaskPrompt(name, prompt.text, (prompt.answer,), length, depth, len(prompt.context))
    if task == "passkey_prose":
        rng = random.Random(f"passkey_prose:{seed}:{length}:{depth}")
        prompt = passkey_prompt(tokenizer, length, depth, seed, lambda n: haystack_text(corpus, tokenizer, n, rng))
        return TaskPrompt(name, prompt.text, (prompt.answer,), length, depth, len(prompt.context))
    if task == "needle":
        index = seed % len(EVALUATION_NEEDLES)
        probe = needle_probe(corpus, tokenizer, length, depth, index, seed, chat=chat, needles=EVALUATION_NEEDLES)
        return TaskPrompt(name, probe.prompt, (probe.answer,), length, depth, question_start(probe.prompt))
    if task == "multikey":
        rng = random.Random(f"multikey:{seed}:{length}:{depth}")
        keys = rng.sample(MULTIKEY_KEYS, 4)
        values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
        return magic_numbers(keys, values, f"the special magic number for {keys[0]}", values[:1])
    if task == "multivalue":
        rng = random.Random(f"multivalue:{seed}:{length}:{depth}")
        key = rng.choice(MULTIKEY_KEYS)
        values = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(len(OTHER_NEEDLE_OFFSETS) + 1)]
        return magic_numbers([key] * len(values), values, f"all the special magic numbers for {key}", values)
    raise ValueError(f"unknown task {task!r} (tasks: {', '.join(TASKS)}, multivalue)")


def insert_sentences(context: str, placed: list[tuple[float, str]]) -> str:
    """Insert each (depth, sentence) after the first sentence end at or after that relative depth, in order."""
    for depth, sentence in placed:
        found = context.find(". ", int(depth * len(context)))
        cut = found + 2 if found >= 0 else len(context)
        context = context[:cut] + sentence + " " + context[cut:]
    return context


def question_start(prompt: str) -> int:
    return prompt.rindex(QUESTION_TEMPLATE.split("{")[0])
