"""`kvcompile distill`, torch-free: its settings are checked here before anything heavy loads; the work (the
second pass, the ridge fit) is in `distill.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompile.recipe import CorpusRecipe
from kvcompile.recipes.distilled.settings import DistillSettings


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
        shares = artifact.params["share_prompts"]
        lookahead = artifact.params.get("lookahead")
        queries = (
            f"; {lookahead['queries']} lookahead queries (on {artifact.params.get('lookahead_on', 'all')} prompts), KL "
            f"to the oracle {lookahead['kl_first_step']:.3f} at the first step, {lookahead['kl_last_tenth']:.3f} over "
            "the last tenth"
            + (
                f", {lookahead['kl_held_out']:.3f} on {lookahead['held_out']} contexts never trained on"
                if "kl_held_out" in lookahead
                else ""
            )
            if isinstance(lookahead, dict)
            else "; no lookahead queries"
        )
        return (
            f"held-out R^2 of the log-scores per layer: median {median:.3f}, range {low:.3f}-{high:.3f}; layer shares "
            f"averaged over {shares}{queries}"
        )
