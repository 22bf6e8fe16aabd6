"""CompressKV's two compile commands, torch-free: `kvcompile heads` (SRH head scores on needle probes) and
`kvcompile layer-errors` (each layer's compression error). Settings are checked and inputs read here before anything
heavy loads; the work is in `heads.py` and `layer_errors.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompile.recipe import CorpusRecipe
from kvcompile.recipes.compresskv.settings import HeadsSettings, LayerErrorsSettings
from kvruntime import KVRuntimeError


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


class LayerErrorsRecipe(CorpusRecipe):
    """The layer errors of the selection of an srh_heads artifact (`heads`, checked against the model)."""

    kind = "layer_budgets"

    def __init__(self, corpus: str | None = None, heads: Path | None = None) -> None:
        super().__init__(corpus)
        self.heads = heads

    def positions(self, settings: LayerErrorsSettings) -> tuple[int, str]:
        tokens = settings.prompt_tokens + settings.new_tokens
        return tokens, f"--prompt-tokens {settings.prompt_tokens} and --new-tokens {settings.new_tokens}"

    def prepare(self, settings: LayerErrorsSettings) -> Any:
        from kvruntime.artifacts.artifact_header import read_header

        if self.heads is not None:
            kind = read_header(self.heads).get("kind")  # a missing or foreign file is refused before torch loads
            if kind != "srh_heads":
                raise KVRuntimeError(f"--heads {self.heads}: a {kind} artifact, not srh_heads")
            from kvruntime import read_artifact

            read_artifact(self.heads)  # and a broken one before the model loads
        return super().prepare(settings)

    def run(self, job: Any, settings: LayerErrorsSettings, corpus: Any) -> Any:
        from kvcompile.recipes.compresskv.layer_errors import compile_layer_errors
        from kvruntime import load_artifact

        heads = load_artifact(self.heads, model=job.model, kind="srh_heads")
        return compile_layer_errors(job, corpus, heads, settings)

    def finish(self, sums: dict, run: Any) -> Any:
        from kvcompile.recipes.compresskv.layer_errors import finish_layer_budgets

        return finish_layer_budgets(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        from kvcompile.recipes.compresskv.plots import plot_layer_budgets

        return plot_layer_budgets(artifact, path)
