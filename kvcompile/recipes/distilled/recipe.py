"""`kvcompile distill`, torch-free: its settings are checked here before anything heavy loads; the work (the
second pass, the ridge fit) is in `distill.py`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvcompile.recipe import CorpusRecipe
from kvruntime import KVRuntimeError

ORACLES = ("reconstruction", "repeat")
HELD_OUT_EVERY = 4  # prompts 3, 7, 11, ... choose the ridge strength


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    prompts: int = 32  # calibration prompts (every 4th held out to choose the ridge strength)
    prompt_tokens: int = 2048  # tokens per calibration prompt
    oracle: str = "reconstruction"  # the second pass distilled (ORACLES)
    seed: int = 0

    def check(self) -> None:
        if self.oracle not in ORACLES:
            raise KVRuntimeError(f"--oracle {self.oracle!r}: use one of {', '.join(ORACLES)}")
        if self.prompts < HELD_OUT_EVERY:
            raise KVRuntimeError(f"--prompts must be at least {HELD_OUT_EVERY} (every {HELD_OUT_EVERY}th is held out)")
        if self.prompt_tokens < 64:
            raise KVRuntimeError("--prompt-tokens must be at least 64")


class DistillRecipe(CorpusRecipe):
    kind = "distilled_scorer"

    def positions(self, settings: DistillSettings) -> tuple[int, str]:
        # The second pass reads the context again after it.
        return 2 * settings.prompt_tokens, f"--prompt-tokens {settings.prompt_tokens} read twice (the second pass)"

    def run(self, job: Any, settings: DistillSettings, corpus: Any) -> Any:
        from kvcompile.recipes.distilled.distill import compile_distilled_scorer

        return compile_distilled_scorer(job, corpus, settings)

    def finish(self, sums: dict, run: Any) -> Any:
        from kvcompile.recipes.distilled.distill import finish_distilled_scorer

        return finish_distilled_scorer(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.distilled.plots import plot_distilled_scorer

        return plot_distilled_scorer(artifact, path)

    def describe(self, artifact: Any) -> str:
        r2 = artifact.tensors["held_out_r2"].max(dim=1).values
        median, low, high = float(r2.median()), float(r2.min()), float(r2.max())
        return f"held-out R^2 of the log-scores per layer: median {median:.3f}, range {low:.3f}-{high:.3f}"
