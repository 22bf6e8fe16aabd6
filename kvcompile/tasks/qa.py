"""Question answering over shipped text: questions about Moby-Dick's first chapters (the held-out book), each with
the sentence that answers it placed at a chosen depth of a window of the book."""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.corpus import Corpus
from kvcompile.tasks.needles import QUESTION_TEMPLATE, render_prompt
from kvcompile.tasks.retrieval import TaskPrompt, question_start
from kvruntime import KVRuntimeError


@dataclasses.dataclass(frozen=True)
class BookQuestion:
    question: str
    answer: str
    evidence: str  # the words of the book that answer it


MOBY_DICK_QUESTIONS = (
    BookQuestion(
        "In which town did the narrator arrive after quitting Manhatto?", "New Bedford", "I duly arrived in New Bedford"
    ),
    BookQuestion(
        "In which month did the narrator arrive in New Bedford?", "December", "It was a Saturday night in December"
    ),
    BookQuestion(
        "For which island had the little packet already sailed?",
        "Nantucket",
        "the little packet for Nantucket had already sailed",
    ),
    BookQuestion(
        "Whose name was painted under the words The Spouter Inn on the sign?",
        "Peter Coffin",
        "The Spouter Inn:--Peter Coffin",
    ),
    BookQuestion(
        "Which sign did the narrator pass first, finding it too expensive and jolly?",
        "Crossed Harpoons",
        'passed the sign of "The Crossed Harpoons"',
    ),
    BookQuestion(
        "By which name did they call the little withered old man at the bar?",
        "Jonah",
        "like another cursed Jonah (by which name indeed they called him)",
    ),
    BookQuestion(
        "What potion did the barkeeper mix for the man with a bad cold?",
        "gin and molasses",
        "a pitch-like potion of gin and molasses",
    ),
)


def book_qa_prompt(
    corpus: Corpus, tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, chat: bool = True
) -> TaskPrompt:
    """A window of about `length` tokens of the book holding the answer's evidence as near `depth` as the book
    allows (the depth stored is the one reached), then the question."""
    item = MOBY_DICK_QUESTIONS[seed % len(MOBY_DICK_QUESTIONS)]
    document = next((d for d in corpus.documents if item.evidence in " ".join(d.split())), None)
    if document is None:
        raise KVRuntimeError(f"corpus {corpus.name} does not hold the text the book questions are about")
    document = " ".join(document.split())  # one space between words, so the evidence matches across line breaks
    question = QUESTION_TEMPLATE.format(question=item.question)
    window = length - len(tokenizer(question).input_ids) - 24
    encoded = tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if len(ids) < window:
        raise KVRuntimeError(f"the book has {len(ids)} tokens, too few for {length}-token questions")
    evidence = next(i for i, (a, b) in enumerate(offsets) if b > document.index(item.evidence))
    start = min(max(0, evidence - round(depth * window)), len(ids) - window)
    context = tokenizer.decode(ids[start : start + window])
    prompt = render_prompt(tokenizer, context + question, chat)
    reached = (evidence - start) / window
    return TaskPrompt("qa", prompt, (item.answer,), length, round(reached, 3), question_start(prompt))
