"""The distilled scorer's compile stage (`kvcompile distill`): the second pass's scores on calibration prompts
and the ridge fit of a one-pass student (`distill.py`). Picture in `plots.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompile.calibration.job import CompileJob
from kvcompile.recipe import Recipe


class DistillRecipe(Recipe):
    kind = "distilled_scorer"
    shardable = True

    def __init__(self, corpus: str | None = None) -> None:
        self.corpus = corpus

    def prepare(self, settings: Any) -> Any:
        from kvcompile.calibration.corpus import load_corpus

        return load_corpus(self.corpus)

    def run(self, job: CompileJob, settings: Any, corpus: Any) -> Any:
        from kvcompile.recipes.distilled.distill import compile_distilled_scorer

        return compile_distilled_scorer(job, corpus, settings)

    def finish(self, sums: dict, run: Any) -> Any:
        from kvcompile.recipes.distilled.distill import finish_distilled_scorer

        return finish_distilled_scorer(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.distilled.plots import plot_distilled_scorer

        return plot_distilled_scorer(artifact, path)

    def describe(self, artifact: Any) -> str | None:
        r2 = artifact.tensors["held_out_r2"].max(dim=1).values
        return (
            f"held-out R^2 of the log-scores per layer: median {float(r2.median()):.3f}, "
            f"range {float(r2.min()):.3f}-{float(r2.max()):.3f}"
        )
