"""The runtime's default method and ratio for a model (`kvcompile tune`): the evaluation suite on validation
prompts, per method the largest ratio within a tolerance of the full cache (`tuning.py`). Picture in `plots.py`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kvcompile.calibration.job import CompileJob
from kvcompile.recipe import Recipe


class TuneRecipe(Recipe):
    kind = "tuned_defaults"

    def __init__(
        self, methods: str = "", artifacts: Path | None = None, records: Path | None = None, model: str = ""
    ) -> None:
        self.methods = methods  # --methods: runtime methods, options as name:key=value
        self.artifacts = artifacts  # the folder of the artifacts the methods need
        self.records = records  # the run records' folder (for --resume), removed once the artifact is written
        self.model = model

    def prepare(self, settings: Any) -> Any:
        from kvcompile.evaluation.contestants import artifact_paths, check_contestants, parse_methods
        from kvruntime import KVRuntimeError

        contestants = parse_methods(self.methods)
        if any(c.kind == "kvpress" for c in contestants):
            raise KVRuntimeError(
                "tune recommends a runtime method: kvpress presses can be compared with kvcompile eval only"
            )
        paths = artifact_paths(contestants, self.artifacts)
        check_contestants(contestants, paths, settings.suite.ratios)
        return contestants, paths

    def run(self, job: CompileJob, settings: Any, inputs: Any) -> Any:
        import dataclasses

        from kvcompile.evaluation.store import RunStore
        from kvcompile.recipes.tuned_defaults.tuning import tune

        contestants, paths = inputs
        record = {
            "model": self.model,
            "methods": [c.label for c in contestants],
            "tolerance": settings.tolerance,
            **dataclasses.asdict(settings.suite),
        }
        store = RunStore(self.records, record, job.resume)
        return tune(
            job.model, job.tokenizer, contestants, paths, settings.suite, settings.tolerance, store, job.out.parent
        )

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.tuned_defaults.plots import plot_tuned_defaults

        return plot_tuned_defaults(artifact, path)

    def describe(self, artifact: Any) -> str | None:
        from kvcompile.recipes.tuned_defaults.tuning import describe_tuning

        return describe_tuning(artifact)

    def written(self, job: CompileJob, artifact: Any) -> None:
        shutil.rmtree(self.records, ignore_errors=True)  # the run records are in the artifact now
