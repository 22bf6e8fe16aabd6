"""KVCompose's compile stage (`kvcompile stats`): attention statistics over calibration prompts, the layer
allocation for each compiled ratio (`attention_stats.py`). Picture in `plots.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompile.calibration.job import CompileJob
from kvcompile.recipe import Recipe


class StatsRecipe(Recipe):
    kind = "kvcompose_stats"
    shardable = True

    def __init__(self, corpus: str | None = None, task_set: Path | None = None) -> None:
        self.corpus = corpus
        self.task_set = task_set  # task-aware mode: downstream prompts, one per line (None: task-agnostic)

    def prepare(self, settings: Any) -> Any:
        from kvcompile.calibration.corpus import load_corpus
        from kvcompile.recipes.kvcompose.attention_stats import load_task_set

        tasks = load_task_set(self.task_set) if self.task_set is not None else None
        return load_corpus(self.corpus), tasks

    def run(self, job: CompileJob, settings: Any, inputs: Any) -> Any:
        from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats

        corpus, tasks = inputs
        return compile_attention_stats(job, corpus, settings, tasks)

    def finish(self, sums: dict, run: Any) -> Any:
        from kvcompile.recipes.kvcompose.attention_stats import finish_attention_stats

        return finish_attention_stats(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.kvcompose.plots import plot_kvcompose_stats

        return plot_kvcompose_stats(artifact, path)
