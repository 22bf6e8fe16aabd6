"""CompressKV's two compile commands, torch-free: `kvcompile heads` (SRH head scores on needle probes) and
`kvcompile budgets` (each layer's compression error). Settings are checked and inputs read here before anything
heavy loads; the work is in `heads.py` and `budgets.py`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvcompile.recipe import CorpusRecipe
from kvruntime import KVRuntimeError

MIN_PROBE_TOKENS = 128  # a needle sentence, its question and some haystack around it


@dataclasses.dataclass(frozen=True)
class HeadsSettings:
    """The needle-probe grid: context lengths (tokens) x needle depths (0 = start, 1 = end) x needles."""

    lengths: tuple[int, ...] = (512, 1024, 1536, 2048)
    depths: tuple[float, ...] = (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1)
    seed: int = 0
    chat: bool = True  # probes in the model's chat template (instruct models), else raw text

    def check(self) -> None:
        if not self.lengths or not self.depths or any(not 0 <= d <= 1 for d in self.depths):
            raise KVRuntimeError("--lengths needs at least one length and --depths values in [0, 1]")
        if min(self.lengths) < MIN_PROBE_TOKENS:
            raise KVRuntimeError(
                f"--lengths {min(self.lengths)}: a needle probe needs at least {MIN_PROBE_TOKENS} tokens"
            )


class HeadsRecipe(CorpusRecipe):
    kind = "srh_heads"

    def positions(self, settings: HeadsSettings) -> tuple[int, str]:
        return max(settings.lengths), f"--lengths {max(settings.lengths)}"

    def run(self, job: Any, settings: HeadsSettings, corpus: Any) -> Any:
        from kvcompile.recipes.compresskv.heads import compile_head_scores

        return compile_head_scores(job, corpus, settings)

    def finish(self, sums: dict, run: Any) -> Any:
        from kvcompile.recipes.compresskv.heads import finish_head_scores

        return finish_head_scores(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.compresskv.plots import plot_head_scores

        return plot_head_scores(artifact, path)

    def describe(self, artifact: Any) -> str:
        from kvcompile.recipes.compresskv.head_comparison import describe_head_comparison

        return describe_head_comparison(artifact)


@dataclasses.dataclass(frozen=True)
class BudgetsSettings:
    prompts: int = 24  # calibration prompts
    prompt_tokens: int = 1024  # tokens per calibration prompt
    new_tokens: int = 32  # greedy decoding steps measured per prompt
    seed: int = 0

    def check(self) -> None:
        if min(self.prompts, self.prompt_tokens, self.new_tokens) < 1:
            raise KVRuntimeError("--prompts, --prompt-tokens and --new-tokens must be positive")


class BudgetsRecipe(CorpusRecipe):
    """The layer errors of the selection of an srh_heads artifact (`heads`, checked against the model)."""

    kind = "layer_budgets"

    def __init__(self, corpus: str | None = None, heads: Path | None = None) -> None:
        super().__init__(corpus)
        self.heads = heads

    def positions(self, settings: BudgetsSettings) -> tuple[int, str]:
        tokens = settings.prompt_tokens + settings.new_tokens
        return tokens, f"--prompt-tokens {settings.prompt_tokens} and --new-tokens {settings.new_tokens}"

    def prepare(self, settings: BudgetsSettings) -> Any:
        from kvruntime import read_header

        if self.heads is not None:
            kind = read_header(self.heads).get("kind")  # a missing or foreign file is refused before torch loads
            if kind != "srh_heads":
                raise KVRuntimeError(f"--heads {self.heads}: a {kind} artifact, not srh_heads")
            from kvruntime import read_artifact

            read_artifact(self.heads)  # and a broken one before the model loads
        return super().prepare(settings)

    def run(self, job: Any, settings: BudgetsSettings, corpus: Any) -> Any:
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
