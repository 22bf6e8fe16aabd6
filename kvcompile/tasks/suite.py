"""The evaluation suite (RULER-style): which tasks exist, and the prompts of a run (task x length x sample).

Haystacks and needles differ from the calibration data: the book text is Moby-Dick (calibration reads Austen) and
the needles, keys and questions are the evaluation ones. Sample i of a task with a depth puts its fact at depth
0.1 + 0.8 i / (samples - 1) (0.5 for one sample), so that the samples of each length cover the context."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.corpus import Corpus
from kvcompile.prompt_format import uses_chat
from kvcompile.tasks.aggregation import common_words_prompt, variable_tracking_prompt
from kvcompile.tasks.qa import book_qa_prompt
from kvcompile.tasks.retrieval import TaskPrompt, retrieval_prompt
from kvruntime import KVRuntimeError

# (corpus, tokenizer, length, depth, seed, chat) -> prompt
Generator = Callable[[Corpus, PreTrainedTokenizerBase, int, float, int, bool], TaskPrompt]

SUITE: dict[str, Generator] = {
    "passkey": lambda c, t, n, d, s, chat: retrieval_prompt("passkey", c, t, n, d, s, chat),
    "needle": lambda c, t, n, d, s, chat: retrieval_prompt("needle", c, t, n, d, s, chat),
    "multikey": lambda c, t, n, d, s, chat: retrieval_prompt("multikey", c, t, n, d, s, chat),
    "multivalue": lambda c, t, n, d, s, chat: retrieval_prompt("multivalue", c, t, n, d, s, chat),
    "variable_tracking": lambda c, t, n, d, s, chat: variable_tracking_prompt(t, n, d, s, chat),
    "common_words": lambda c, t, n, d, s, chat: common_words_prompt(c, t, n, s, chat),
    "qa": book_qa_prompt,
}
SUITE_TASKS = tuple(SUITE)
WITHOUT_DEPTH = ("common_words",)


def parse_lengths(text: str) -> list[int]:
    """'2k,4k,1500' -> [2048, 4096, 1500]."""
    lengths = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        try:
            lengths.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
        except ValueError:
            raise KVRuntimeError(f"--lengths: {part!r} is not a length (write 2k, 4k or a token count)") from None
    if not lengths or min(lengths) < 256:
        raise KVRuntimeError("--lengths needs context lengths of at least 256 tokens")
    return lengths


def check_tasks(tasks: Sequence[str]) -> None:
    unknown = [t for t in tasks if t not in SUITE]
    if unknown or not tasks:
        raise KVRuntimeError(f"unknown tasks {unknown or '(none given)'} (tasks: {', '.join(SUITE_TASKS)})")


def sample_depth(sample: int, samples: int) -> float:
    return 0.5 if samples == 1 else round(0.1 + 0.8 * sample / (samples - 1), 3)


def parse_tasks(text: str) -> tuple[tuple[str, ...], dict[str, int]]:
    """'passkey,qa,common_words:2' -> the tasks, and the prompts per length of those given a count of their own."""
    tasks, counts = [], {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        task, _, count = part.partition(":")
        tasks.append(task)
        if count:
            if not count.isdigit() or int(count) < 1:
                raise KVRuntimeError(f"--tasks: {part!r} needs a count of at least 1 after the colon (common_words:2)")
            counts[task] = int(count)
    check_tasks(tasks)
    return tuple(tasks), counts


def suite_cells(
    tasks: Sequence[str], lengths: Sequence[int], samples: int | Mapping[str, int]
) -> list[tuple[str, int, int, int]]:
    """(task, length, sample, samples of that task) of each prompt of a run, in the order of its prompts: task by
    task, length by length. `samples`: prompts per task and length, or per task (a mapping)."""
    counts = {task: samples[task] if isinstance(samples, Mapping) else samples for task in tasks}
    if min(counts.values(), default=1) < 1:
        raise KVRuntimeError("--samples must be at least 1")
    return [
        (task, length, sample, counts[task]) for task in tasks for length in lengths for sample in range(counts[task])
    ]


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
