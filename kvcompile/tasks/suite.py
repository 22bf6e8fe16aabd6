"""The evaluation suite (RULER-style): the prompt generator of each task (`grid.SUITE_TASKS`), and the prompts of a run.

Haystacks and needles differ from the calibration data: the book text is Moby-Dick (calibration reads Austen) and
the needles, keys and questions are the evaluation ones; the real-text tasks read code, documentation and a second
book that no compile command reads (`real_text.py`). Sample i of a task with a depth puts its fact at depth
0.1 + 0.8 i / (samples - 1) (0.5 for one sample), so that the samples of each length cover the context."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvcompile.prompt_format import uses_chat
from kvcompile.tasks.aggregation import common_words_prompt, variable_tracking_prompt
from kvcompile.tasks.grid import check_tasks, sample_depth, suite_cells
from kvcompile.tasks.qa import book_qa_prompt
from kvcompile.tasks.real_text import REAL_TEXT_TASKS, real_text_prompt
from kvcompile.tasks.retrieval import TASKS as RETRIEVAL_TASKS
from kvcompile.tasks.retrieval import TaskPrompt, retrieval_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvcompile.calibration.corpus import Corpus

# (corpus, tokenizer, length, depth, seed, chat) -> prompt
Generator = Callable[["Corpus", "PreTrainedTokenizerBase", int, float, int, bool], TaskPrompt]

SUITE: dict[str, Generator] = {
    **{task: functools.partial(retrieval_prompt, task) for task in (*RETRIEVAL_TASKS, "multivalue")},
    "variable_tracking": lambda c, t, n, d, s, chat: variable_tracking_prompt(t, n, d, s, chat),
    "common_words": lambda c, t, n, d, s, chat: common_words_prompt(c, t, n, s, chat),
    "qa": book_qa_prompt,
    # Each real-text task reads its own held-out text (calibration_data/held_out/), not the run's book.
    **{
        task: functools.partial(lambda task, c, t, n, d, s, chat: real_text_prompt(task, t, n, d, s, chat), task)
        for task in REAL_TEXT_TASKS
    },
}


def suite_prompts(
    corpus: Corpus,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples: int | Mapping[str, int],
    seed: int,
    prompt_format: str = "auto",
) -> list[TaskPrompt]:
    """The prompts of a run (`suite_cells`). `prompt_format`: `chat` (the model's chat template), `raw` (plain text
    ending in an answer cue, for base models) or `auto` (chat when the tokenizer has a template)."""
    check_tasks(tasks)
    cells = suite_cells(tasks, lengths, samples)
    chat = uses_chat(tokenizer, prompt_format)
    return [
        SUITE[task](corpus, tokenizer, length, sample_depth(sample, count), seed * 1000 + sample, chat)
        for task, length, sample, count in cells
    ]
