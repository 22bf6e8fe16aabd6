"""`kvcompile stats` (KVCompose's attention statistics), torch-free: settings and the task set are checked here
before anything heavy loads; the work is in `attention_stats.py`."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from kvcompile.recipe import CorpusRecipe
from kvruntime import METHODS, KVRuntimeError

WINDOW = METHODS["kvcompose"].window  # the runtime's protected window: the least a layer keeps


@dataclasses.dataclass(frozen=True)
class TaskSet:
    """Downstream prompts for the task-aware mode, one per line of a UTF-8 text file."""

    name: str
    prompts: tuple[str, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256("\n".join(self.prompts).encode()).hexdigest()


def load_task_set(path: Path) -> TaskSet:
    if not path.is_file():
        raise KVRuntimeError(f"task set {path} does not exist (a text file with one task prompt per line)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise KVRuntimeError(f"task set {path} is not UTF-8 text") from None
    prompts = tuple(line.strip() for line in lines if line.strip())
    if not prompts:
        raise KVRuntimeError(f"task set {path} holds no prompts (one task prompt per line)")
    return TaskSet(name=str(path), prompts=prompts)


@dataclasses.dataclass(frozen=True)
class StatsSettings:
    ratios: tuple[float, ...]
    prompts: int = 24
    prompt_tokens: int = 2048
    seed: int = 0

    def check(self) -> None:
        if not self.ratios or any(not 0 < r < 1 for r in self.ratios):
            raise KVRuntimeError(f"--ratios {list(self.ratios)}: give ratios strictly between 0 and 1")
        if any(b <= a for a, b in zip(self.ratios, self.ratios[1:])):
            raise KVRuntimeError(f"--ratios {list(self.ratios)}: give them in increasing order, each once")
        if self.prompts < 1:
            raise KVRuntimeError("--prompts must be at least 1")
        if self.prompt_tokens < 2 * WINDOW:
            raise KVRuntimeError(f"--prompt-tokens must be at least {2 * WINDOW} (twice the protected window)")


class StatsRecipe(CorpusRecipe):
    """Task-agnostic, or task-aware with a task set (a text file of downstream prompts, one per line)."""

    kind = "kvcompose_stats"

    def __init__(self, corpus: str | None = None, task_set: Path | None = None) -> None:
        super().__init__(corpus)
        self.task_set = task_set

    def positions(self, settings: StatsSettings) -> tuple[int, str]:
        # Task-agnostic: the context is read again as its own task.
        return 2 * settings.prompt_tokens, f"--prompt-tokens {settings.prompt_tokens} read twice (the second pass)"

    def prepare(self, settings: StatsSettings) -> tuple[Any, TaskSet | None]:
        tasks = load_task_set(self.task_set) if self.task_set is not None else None
        return super().prepare(settings), tasks

    def run(self, job: Any, settings: StatsSettings, inputs: tuple[Any, TaskSet | None]) -> Any:
        from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats

        corpus, tasks = inputs
        return compile_attention_stats(job, corpus, settings, tasks)

    def finish(self, sums: dict, run: Any) -> Any:
        from kvcompile.recipes.kvcompose.attention_stats import finish_attention_stats

        return finish_attention_stats(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.kvcompose.plots import plot_kvcompose_stats

        return plot_kvcompose_stats(artifact, path)
