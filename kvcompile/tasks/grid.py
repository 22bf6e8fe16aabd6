"""Which tasks the evaluation suite has, and the grid of a run's prompts (task x length x sample), torch-free: the
command line checks --tasks and --lengths with these before it imports anything heavy. The prompts themselves are
made in `suite.py`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvruntime import KVRuntimeError

# Each task and the text its context is made of: results are judged per text type, never pooled (issue #63).
TEXT_TYPES = {
    "passkey": "filler",
    "passkey_prose": "moby-dick",
    "needle": "moby-dick",
    "needle_filler": "filler",
    "multikey": "moby-dick",
    "multikey_filler": "filler",
    "multivalue": "moby-dick",
    "variable_tracking": "synthetic",
    "common_words": "synthetic",
    "qa": "moby-dick",
    "code_signature": "code",
    "code_continuation": "code",
    "docs_sentence": "docs",
    "docs_continuation": "docs",
    "jekyll_sentence": "jekyll",
    "jekyll_continuation": "jekyll",
}
SUITE_TASKS = tuple(TEXT_TYPES)
# Tasks whose depth places nothing (a continuation's window ends where its answer starts).
WITHOUT_DEPTH = ("common_words", "code_continuation", "docs_continuation", "jekyll_continuation")


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
    unknown = [t for t in tasks if t not in SUITE_TASKS]
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
