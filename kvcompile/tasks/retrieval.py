"""Held-out long-context retrieval prompts for measuring compressed generation (never used for calibration):
the pass key in repeated filler, one needle in Moby-Dick, and several key-value needles (RULER's multi-key NIAH).
Each prompt is scored by exact match: every expected value must appear in the generated text."""

from __future__ import annotations

import dataclasses
import random

from transformers import PreTrainedTokenizerBase

from ..corpus import Corpus
from .needles import QUESTION_TEMPLATE, Needle, needle_probe, render_prompt
from .passkey import passkey_prompt

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
TASKS = ("passkey", "needle", "multikey")


@dataclasses.dataclass(frozen=True)
class RetrievalPrompt:
    task: str
    prompt: str
    expected: tuple[str, ...]
    length: int
    depth: float
    question_start: int  # character where the question begins: the context alone is prompt[:question_start]

    def score(self, generated: str) -> bool:
        return all(value.lower() in generated.lower() for value in self.expected)


def retrieval_prompt(
    task: str, corpus: Corpus, tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int
) -> RetrievalPrompt:
    if task == "passkey":
        prompt = passkey_prompt(tokenizer, length, depth, seed)
        return RetrievalPrompt(task, prompt.text, (prompt.answer,), length, depth, len(prompt.context))
    if task == "needle":
        index = seed % len(EVALUATION_NEEDLES)
        probe = needle_probe(corpus, tokenizer, length, depth, index, seed, chat=True, needles=EVALUATION_NEEDLES)
        return RetrievalPrompt(task, probe.prompt, (probe.answer,), length, depth, _question_start(probe.prompt))
    if task == "multikey":
        return _multikey(corpus, tokenizer, length, depth, seed)
    raise ValueError(f"unknown task {task!r} (tasks: {', '.join(TASKS)})")


def _multikey(corpus: Corpus, tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int) -> RetrievalPrompt:
    """Four key-value needles at spread depths; the question asks for the one placed at `depth`."""
    rng = random.Random(f"multikey:{seed}:{length}:{depth}")
    keys = rng.sample(MULTIKEY_KEYS, 4)
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
    asked = 0
    sentences = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
    question = QUESTION_TEMPLATE.format(question=f"What is the special magic number for {keys[asked]}?")
    base = needle_probe(
        corpus, tokenizer, length - 20 * len(keys), depth, 0, seed, chat=False,
        needles=(Needle(sentences[asked], "", values[asked]),),
    )
    context = base.prompt[: base.prompt.index(QUESTION_TEMPLATE.split("{")[0])]
    # The distractor keys go at other depths, each after a sentence end.
    for offset, sentence in zip((0.3, 0.55, 0.8), sentences[1:]):
        cut = context.find(". ", int(((depth + offset) % 1.0) * len(context))) + 2
        context = context[:cut] + sentence + " " + context[cut:]
    prompt = render_prompt(tokenizer, context + question, chat=True)
    return RetrievalPrompt("multikey", prompt, (values[asked],), length, depth, _question_start(prompt))


def _question_start(prompt: str) -> int:
    return prompt.rindex(QUESTION_TEMPLATE.split("{")[0])
