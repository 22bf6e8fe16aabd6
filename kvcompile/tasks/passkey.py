"""The pass-key task of RULER: a five-digit key hidden at a given depth in repeated filler (or in book text that
`haystack` gives), asked for at the end."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from kvcompile.tasks.needles import insert_at_depth

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
    context: str  # filler with the pass key sentence inside
    question: str
    answer: str  # the pass key's digits
    depth: float  # where the pass key sits: 0 = start, 1 = end

    @property
    def text(self) -> str:
        return self.context + self.question


def passkey_prompt(
    tokenizer: PreTrainedTokenizerBase,
    tokens: int,
    depth: float,
    seed: int = 0,
    haystack: Callable[[int], str] | None = None,
) -> PasskeyPrompt:
    """A prompt of about `tokens` tokens with the key at relative `depth` (0 = start, 1 = end) of the filler, or
    of `haystack(n)`, about n tokens of text, at its last sentence boundary before `depth`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} is outside [0, 1]")
    key = str(random.Random(seed).randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer(INTRO + needle + QUESTION).input_ids)
    if haystack is not None:
        context = INTRO + insert_at_depth(haystack(max(16, tokens - fixed)), needle.strip(), depth)
        return PasskeyPrompt(context=context, question=QUESTION, answer=key, depth=depth)
    repeats = max(1, (tokens - fixed) // len(tokenizer(FILLER).input_ids))
    before = round(depth * repeats)
    context = INTRO + FILLER * before + needle + FILLER * (repeats - before)
    return PasskeyPrompt(context=context, question=QUESTION, answer=key, depth=depth)
