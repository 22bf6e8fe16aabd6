"""CompilerKV's compile stage (`kvcompile tables`): bandit experience from rollouts on calibration prompts
(`experience_collection.py`, records in `bandit_experience.py`, continuation NLL in `continuation_nll.py`), then the
head-reliability and risk-threshold tables learned from it with offline CQL (`offline_cql.py`, rounds in
`tables.py`). Picture in `plots.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompile.calibration.job import CompileJob
from kvcompile.recipe import Recipe


class TablesRecipe(Recipe):
    kind = "compilerkv_tables"

    def __init__(self, corpus: str | None = None, from_experience: Path | None = None) -> None:
        self.corpus = corpus
        self.from_experience = from_experience  # relearn from a stored compilerkv_experience artifact, no rollouts

    def check(self, settings: Any) -> None:
        if self.from_experience is None:  # else the settings are the experience's own
            settings.check()

    def prepare(self, settings: Any) -> Any:
        from kvcompile.calibration.corpus import load_corpus
        from kvruntime import read_artifact

        if self.from_experience is not None:
            read_artifact(self.from_experience)
            return None
        return load_corpus(self.corpus)

    def run(self, job: CompileJob, settings: Any, corpus: Any) -> Any:
        from kvcompile.recipes.compilerkv.tables import compile_tables, relearn_tables
        from kvruntime import load_artifact, save_artifact

        if self.from_experience is not None:
            return relearn_tables(load_artifact(self.from_experience, model=job.model, kind="compilerkv_experience"))
        tables, experience = compile_tables(job, corpus, settings)
        experience_path = job.out.with_name("compilerkv_experience.safetensors")
        save_artifact(experience, experience_path)
        print(f"wrote {experience_path}")
        return tables

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.compilerkv.plots import plot_compilerkv_tables

        return plot_compilerkv_tables(artifact, path)

    def describe(self, artifact: Any) -> str | None:
        from kvcompile.recipes.compilerkv.tables import describe_tables

        return describe_tables(artifact)
