"""`kvcompile tune`, torch-free: its settings, methods and the folder of its run records are checked here before
anything heavy loads; the validation runs and the choice are in `tuning.py`."""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path
from typing import Any

from kvcompile.evaluation.store import check_run_folder, discard_run_records
from kvcompile.recipe import Recipe, run_record_path
from kvcompile.recipes.tuned_defaults.settings import TuneSettings
from kvruntime import KVRuntimeError
from kvruntime.files import write_atomically


class TuneRecipe(Recipe):
    kind = "tuned_defaults"

    def __init__(
        self,
        folder: Path,
        methods: str = "",
        artifacts: tuple[Path, ...] = (),
        records: Path | None = None,
        model: str = "",
    ) -> None:
        self.folder = folder  # where the tuned_defaults is written; the recommended method's artifacts go beside it
        self.methods = methods  # --methods: runtime methods, options as name:key=value
        self.artifacts = artifacts  # the folders of the artifacts the methods need, the first holding one wins
        self.records = records  # the run records' folder (for --resume), removed once the artifact is written
        self.model = model

    def positions(self, settings: TuneSettings) -> tuple[int, str] | None:
        suite = settings.suite
        if suite.suite is not None:  # a user's suite: each prompt is checked once tokenized
            return None
        return max(suite.lengths) + suite.new_tokens, f"--lengths {max(suite.lengths)} and the answer"

    def prepare(self, settings: TuneSettings) -> tuple[list[Any], dict[str, list[Path]]]:
        from kvcompile.evaluation.contestants import RuntimeMethod, artifact_paths, parse_methods, resolve_contestants

        check_run_folder(self.records, option="the run records' folder beside --out:")
        contestants = parse_methods(self.methods)
        if not all(isinstance(c, RuntimeMethod) for c in contestants[1:]):
            raise KVRuntimeError(
                "tune recommends a runtime method: kvpress presses and the quantized full cache can be compared with "
                "kvcompile eval only"
            )
        paths = artifact_paths(contestants, self.artifacts)
        for path in {path for files in paths.values() for path in files}:
            check_copyable_beside(path, self.folder)
        contestants = resolve_contestants(contestants, paths, settings.suite.ratios)
        return contestants, paths

    def run(self, job: Any, settings: TuneSettings, inputs: tuple) -> Any:
        from kvcompile.evaluation.store import RunStore
        from kvcompile.recipes.tuned_defaults.tuning import tune

        contestants, paths = inputs
        record = {"model": self.model, "methods": [c.label for c in contestants], "tolerance": settings.tolerance}
        store = RunStore(self.records, {**record, **settings.suite.record()}, job.resume)
        artifact = tune(job.model, job.tokenizer, contestants, paths, settings.suite, settings.tolerance, store)
        recommended = artifact.params["recommended"]
        if recommended is not None:
            # The runtime finds a tuned default's artifacts beside it only (a file may come from anyone): those of
            # the recommended method found elsewhere (the shipped ones) are copied there before it is written.
            for path in paths[recommended["label"]]:
                copy_beside(path, self.folder)
        return artifact

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.tuned_defaults.plots import plot_tuned_defaults

        return plot_tuned_defaults(artifact, path)

    def describe(self, artifact: Any) -> str:
        from kvcompile.recipes.tuned_defaults.tuning import describe_tuning

        return describe_tuning(artifact)

    def written(self, job: Any, artifact: Any) -> None:
        discard_run_records(self.records)  # the run records are in the artifact now


def check_copyable_beside(path: Path, folder: Path) -> None:
    """Refuse, before the run, an artifact that could not be copied into `folder`: another file of its name there."""
    target = folder / path.name
    if target.exists() and not filecmp.cmp(target, path, shallow=False):
        raise KVRuntimeError(
            f"{target}: the tuned default's folder holds another {path.name} than the one tuned with ({path}); "
            "write --out elsewhere, or pass --artifacts with that folder"
        )


def copy_beside(path: Path, folder: Path) -> None:
    """`path` and its run record copied into `folder`, unless the same file is there already; never over another."""
    check_copyable_beside(path, folder)
    for source in (path, run_record_path(path)):
        target = folder / source.name
        if source.is_file() and not target.exists():
            write_atomically(target, lambda tmp_name, source=source: shutil.copyfile(source, tmp_name))
