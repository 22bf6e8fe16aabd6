"""`kvcompile stats` (KVCompose's attention statistics), torch-free: settings and the task set are checked here
before anything heavy loads; the work is in `attention_stats.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompile.recipe import CorpusRecipe
from kvcompile.recipes.kvcompose.settings import StatsSettings, TaskSet, load_task_set


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
