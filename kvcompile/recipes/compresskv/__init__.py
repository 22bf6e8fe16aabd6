"""CompressKV's compile stage: Semantic Retrieval Head scores from needle probes (`kvcompile heads`: `heads.py`,
the scores' math in `head_scores.py`, attention rows in `attention_capture.py`), then each layer's compression error
for the error-aware budgets (`kvcompile budgets`: `budgets.py`). Pictures in `plots.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompile.calibration.job import CompileJob
from kvcompile.recipe import Recipe


class HeadsRecipe(Recipe):
    kind = "srh_heads"
    shardable = True

    def __init__(self, corpus: str | None = None) -> None:
        self.corpus = corpus

    def prepare(self, settings: Any) -> Any:
        from kvcompile.calibration.corpus import load_corpus

        return load_corpus(self.corpus)

    def check_model(self, settings: Any, model: Any) -> None:
        settings.check_model(model)

    def run(self, job: CompileJob, settings: Any, corpus: Any) -> Any:
        from kvcompile.recipes.compresskv.heads import compile_head_scores

        return compile_head_scores(job, corpus, settings)

    def finish(self, sums: dict, run: Any) -> Any:
        from kvcompile.recipes.compresskv.heads import finish_head_scores

        return finish_head_scores(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.compresskv.plots import plot_head_scores

        return plot_head_scores(artifact, path)

    def describe(self, artifact: Any) -> str | None:
        from kvcompile.recipes.compresskv.head_comparison import describe_head_comparison

        return describe_head_comparison(artifact)


class BudgetsRecipe(Recipe):
    kind = "layer_budgets"
    shardable = True

    def __init__(self, corpus: str | None = None, heads: Path | None = None) -> None:
        self.corpus = corpus
        self.heads = heads  # the srh_heads artifact whose selection is measured

    def prepare(self, settings: Any) -> Any:
        from kvcompile.calibration.corpus import load_corpus
        from kvruntime import read_artifact

        corpus = load_corpus(self.corpus)
        if self.heads is not None:
            read_artifact(self.heads)  # a missing or broken file is refused before the model loads
        return corpus

    def run(self, job: CompileJob, settings: Any, corpus: Any) -> Any:
        from kvcompile.recipes.compresskv.budgets import compile_layer_errors
        from kvruntime import load_artifact

        heads = load_artifact(self.heads, model=job.model, kind="srh_heads")
        return compile_layer_errors(job, corpus, heads, settings)

    def finish(self, sums: dict, run: Any) -> Any:
        from kvcompile.recipes.compresskv.budgets import finish_layer_budgets

        return finish_layer_budgets(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.compresskv.plots import plot_layer_budgets

        return plot_layer_budgets(artifact, path)
