"""Needle-in-a-haystack probes: a sentence with a multi-token answer hidden at a depth of book text, then asked.

The needle goes at the last sentence boundary before the requested depth, and the question follows the context
(CompressKV's probe format). Instruct models get the prompt through their chat template (raw text makes the
default model end its turn at once); base models take the raw text ending in "Answer:".
"""

from __future__ import annotations

import dataclasses
import random
import re

from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.corpus import Corpus, passage_ids
from kvcompile.prompt_format import opened, require_chat_template
from kvruntime import KVRuntimeError


@dataclasses.dataclass(frozen=True)
class Needle:
    sentence: str
    question: str
    answer: str


# Compile-time needles (SRH probes). Evaluation uses other needles, in another book.
CALIBRATION_NEEDLES = (
    Needle(
        "The lighthouse keeper of Penmarch kept his spare key inside a blue teapot on the third shelf.",
        "Where did the lighthouse keeper of Penmarch keep his spare key?",
        "inside a blue teapot on the third shelf",
    ),
    Needle(
        "The secret ingredient of the Harbour Street fish soup is smoked paprika with a spoon of honey.",
        "What is the secret ingredient of the Harbour Street fish soup?",
        "smoked paprika with a spoon of honey",
    ),
    Needle(
        "Captain Ilse Marrow named her first ship the Silver Heron after the bird she saw at dawn.",
        "What did Captain Ilse Marrow name her first ship?",
        "the Silver Heron",
    ),
)

QUESTION_TEMPLATE = "\n\nBased on the content of the book, answer the question. Question: {question}"
RAW_ANSWER_CUE = "\nAnswer:"


@dataclasses.dataclass(frozen=True)
class NeedleProbe:
    prompt: str  # haystack with the needle sentence, then the question
    answer: str
    answer_span: tuple[int, int]  # character span of the answer inside the prompt
    length: int  # tokens of the prompt
    depth: float  # where the needle sits: 0 = start, 1 = end
    needle: int  # index into CALIBRATION_NEEDLES


def haystack_text(corpus: Corpus, tokenizer: PreTrainedTokenizerBase, tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of contiguous text from one document, starting at a random paragraph."""
    return tokenizer.decode(passage_ids(tokenizer, *paragraph_start(corpus, tokens, rng), tokens))


def paragraph_start(corpus: Corpus, tokens: int, rng: random.Random) -> tuple[str, int]:
    """A random document with room for `tokens` tokens (6 characters each), and a random paragraph's start in it."""
    # Indices, from the lengths noted at loading: documents on disk are not all read again for every probe.
    candidates = [index for index, length in enumerate(corpus.lengths) if length > tokens * 6]
    if not candidates:
        raise KVRuntimeError(
            f"corpus {corpus.name} is too short for {tokens}-token probes: no document has {tokens * 6} characters"
        )
    document = corpus.documents[rng.choice(candidates)]
    start = rng.randrange(0, len(document) - tokens * 6)
    return document, document.find("\n\n", start) + 2 if document.find("\n\n", start) >= 0 else start


def needle_probe(
    corpus: Corpus,
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    depth: float,
    needle_index: int,
    seed: int,
    chat: bool,
    needles: tuple[Needle, ...] = CALIBRATION_NEEDLES,
) -> NeedleProbe:
    needle = needles[needle_index]
    question = QUESTION_TEMPLATE.format(question=needle.question)
    overhead = len(tokenizer(" " + needle.sentence + question).input_ids)
    rng = random.Random(f"{seed}:{length}:{depth}:{needle_index}")
    haystack = haystack_text(corpus, tokenizer, max(16, length - overhead), rng)
    context = insert_at_depth(haystack, needle.sentence, depth)
    prompt = render_prompt(tokenizer, context + question, chat)
    start = prompt.index(needle.sentence) + needle.sentence.index(needle.answer)
    return NeedleProbe(prompt, needle.answer, (start, start + len(needle.answer)), length, depth, needle_index)


def insert_at_depth(haystack: str, sentence: str, depth: float) -> str:
    """`sentence` inserted at the last sentence boundary of `haystack` before relative `depth` (or at its start)."""
    cut = int(depth * len(haystack))
    boundaries = [m.end() for m in re.finditer(r"[.!?][\"')\]]?\s", haystack[:cut])]
    cut = boundaries[-1] if boundaries else 0
    prefix = haystack[:cut] + ("" if cut == 0 or haystack[cut - 1].isspace() else " ")
    return prefix + sentence + " " + haystack[cut:]


def render_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool) -> str:
    """The user turn through the model's chat template, or raw text with an answer cue."""
    if not chat:
        return text + RAW_ANSWER_CUE
    require_chat_template(tokenizer)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def probe_grid(
    corpus: Corpus,
    tokenizer: PreTrainedTokenizerBase,
    lengths: list[int],
    depths: list[float],
    seed: int,
    chat: bool,
    needles: tuple[Needle, ...] = CALIBRATION_NEEDLES,
) -> list[NeedleProbe]:
    return [
        needle_probe(corpus, tokenizer, length, depth, index, seed, chat, needles)
        for length in lengths
        for depth in depths
        for index in range(len(needles))
    ]


def answer_token_positions(tokenizer: PreTrainedTokenizerBase, probe: NeedleProbe) -> tuple[list[int], list[int]]:
    """The prompt's token ids and the positions of the tokens that overlap the answer's characters."""
    if not tokenizer.is_fast:
        raise KVRuntimeError("SRH probes need a fast tokenizer (character offsets of the answer tokens)")
    encoded = tokenizer(probe.prompt, return_offsets_mapping=True, add_special_tokens=False)
    ids = opened(tokenizer, encoded["input_ids"])  # a whole prompt: Gemma's <bos> first
    shift = len(ids) - len(encoded["input_ids"])
    start, end = probe.answer_span
    positions = [shift + i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < end and b > start and b > a]
    return ids, positions
