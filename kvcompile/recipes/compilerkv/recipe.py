"""`kvcompile tables` (CompilerKV's head-reliability and risk-threshold tables), torch-free: its settings (the
experience design, the CQL fit) are checked and stored experience is vetted here before anything heavy loads; the
work is in `tables.py` (rounds), `experience_collection.py` (rollouts) and `offline_cql.py` (the fit)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompile.recipe import Recipe
from kvcompile.recipes.compilerkv.settings import (
    TablesSettings,
    check_experience_format,
    experience_path,
)


class TablesRecipe(Recipe):
    kind = "compilerkv_tables"
    devices = ("cpu", "cuda")  # the rollouts run on the model's device; the selection and d3rlpy's CQL on the CPU

    def __init__(self, corpus: str | None = None, from_experience: Path | None = None) -> None:
        self.corpus = corpus
        self.from_experience = from_experience  # relearn from a stored compilerkv_experience artifact, no rollouts

    def check(self, settings: TablesSettings) -> None:
        if self.from_experience is None:  # else the settings are the experience's own
            settings.check()

    def positions(self, settings: TablesSettings) -> tuple[int, str] | None:
        if self.from_experience is not None:
            return None
        tokens = settings.context_tokens + settings.continuation
        return tokens, f"--context-tokens {settings.context_tokens} and --continuation {settings.continuation}"

    def prepare(self, settings: TablesSettings) -> Any:
        from kvcompile.calibration.corpus import load_corpus
        from kvruntime.artifacts.artifact_header import header_params, read_header

        if self.from_experience is not None:
            kind = read_header(self.from_experience).get("kind")
            check_experience_format(self.from_experience, kind, header_params(self.from_experience))
            return None
        return load_corpus(self.corpus)

    def run(self, job: Any, settings: TablesSettings, corpus: Any) -> Any:
        from kvcompile.recipes.compilerkv.tables import compile_tables, relearn_tables
        from kvruntime import load_artifact, save_artifact

        if self.from_experience is not None:
            return relearn_tables(load_artifact(self.from_experience, model=job.model, kind="compilerkv_experience"))
        tables, experience = compile_tables(job, corpus, settings)
        save_artifact(experience, experience_path(job.out))
        print(f"wrote {experience_path(job.out)}")
        return tables

    def companions(self, out: Path) -> dict[Path, str]:
        return {} if self.from_experience is not None else {experience_path(out): "compilerkv_experience"}

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.compilerkv.plots import plot_compilerkv_tables

        return plot_compilerkv_tables(artifact, path)

    def describe(self, artifact: Any) -> str:
        from kvcompile.recipes.compilerkv.tables import describe_tables

        return describe_tables(artifact)
