"""The keys' leverage weight fitted against the teacher instead of chosen by answers (issue #33's lever "the
leverage as a fitted student feature"): on calibration prompts, per layer, the least-squares weight of the leverage
term (`with_leverage` at beta 1: the z-scored log leverage times the student's spread) on what the student misses of
its teacher's log-scores (the oracle minus the student), over the unprotected tokens of every KV head. A stagewise
fit (the student's weights stay as shipped); the rule probe's `fitted leverage` variant then uses these weights.

    python -m benchmarks.distilled.leverage_fit [--prompts 8] [--tokens 2048] [--seed 5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import calibration_prompts, load_corpus
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import prompt_features_and_targets
from kvruntime.math.selection import protect_sinks, protect_window
from kvruntime.methods.distilled import DistilledScorer, predicted_scores, with_leverage
from kvruntime.methods.distilled.spec import SPEC
from kvruntime.plumbing.cache_ops import cache_argument

SCORER = default_artifact("default", "distilled_scorer")
OUT = Path("benchmarks/distilled/leverage_fit.md")  # and its table of weights, `.csv` beside it
WEIGHT = "fitted leverage weight"  # the table's column the rule probe reads


def layer_keys(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's cached keys [1, Hkv, N, D] after a plain prefill (after RoPE, as the runtime's leverage reads)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.base_model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    return [layer.keys.float() for layer in cache.layers]


def leverage_regressor(student: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The term `with_leverage` adds at beta 1 [Hkv, N] (student: protected log-scores [Hkv, N]); nan where
    protected."""
    term = with_leverage(student[None], keys, 1.0, student.shape[-1])[0] - student
    return torch.where(student.isfinite(), term, torch.nan)


def fitted_weights(residuals: list[torch.Tensor], regressors: list[torch.Tensor]) -> torch.Tensor:
    """Per layer, the least-squares slope (with intercept) of the residuals on the regressors, pooled over prompts,
    heads and unprotected tokens: lists over prompts of [L, Hkv, N] -> [L]."""
    e = torch.cat([r.flatten(1) for r in residuals], dim=1)
    x = torch.cat([r.flatten(1) for r in regressors], dim=1)
    valid = x.isfinite()
    slopes = []
    for layer in range(e.shape[0]):
        el, xl = e[layer][valid[layer]].double(), x[layer][valid[layer]].double()
        xc = xl - xl.mean()
        slopes.append(float((xc * (el - el.mean())).sum() / (xc * xc).sum()))
    return torch.tensor(slopes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=5, help="offsets in the calibration text (the scorer used 0)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    model, tokenizer = kvruntime.load_model()
    scorer = DistilledScorer.from_artifact(kvruntime.load_artifact(SCORER, model=model))
    sinks = int(SPEC.options["sinks"].default)
    prompts = calibration_prompts(load_corpus("austen-repeats"), tokenizer, args.prompts, args.tokens, args.seed)
    residuals, regressors = [], []
    for _, ids in tqdm(prompts, desc="leverage fit", unit="prompt"):
        features, targets = prompt_features_and_targets(model, tokenizer, ids, scorer.oracle)
        keys = layer_keys(model, ids)
        res, reg = [], []
        for layer, x in enumerate(features):
            student = predicted_scores(x[None].float(), scorer.weights[layer].float())[0]  # [Hkv, N]
            student = protect_sinks(protect_window(student, SPEC.window), sinks)
            reg.append(leverage_regressor(student, keys[layer]))
            res.append(targets[layer].float() - student)
        residuals.append(torch.stack(res))
        regressors.append(torch.stack(reg))
    weights = fitted_weights(residuals, regressors)
    rows = [{"layer": layer, WEIGHT: f"{w:.3f}"} for layer, w in enumerate(weights.tolist())]
    lines = [
        "# The leverage weight fitted against the teacher, per layer",
        "",
        *run_header(),
        f"{len(prompts)} `austen-repeats` prompts of "
        f"{args.tokens} tokens (seed {args.seed}), oracle `{scorer.oracle}`. The default adds the term at weight 2 in "
        f"every layer; fitted: mean {weights.mean():.3f}, range {weights.min():.3f} to {weights.max():.3f}.",
        "",
        *markdown_table(rows),
    ]
    write_results(rows, args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
