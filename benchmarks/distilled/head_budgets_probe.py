"""The teacher gap split into within-head selection and across-head allocation (issue #74, item 3).

    python -m benchmarks.distilled.head_budgets_probe [--model default] [--prompts 4] [--tokens 1024] [--calibration 8]

Per layer the runtime cuts, each KV head keeps the same count k (the compiled layer shares; `memory=padded`). In
the teacher's score mass (each head's distribution over the prompt, the sinks and the window left out), over what
the teacher's own top-k per head holds, on held-out prompts per text type:
- `scorer`: the shipped scorer's top-k per head (the student's log-scores averaged with its lookahead queries', as the
  runtime does): 1 minus it is what within-head selection loses;
- `teacher, best split`: the teacher with the layer's Hkv * k entries split over its heads as this prompt's mass asks
  (known only after two passes): what across-head allocation can gain at most;
- `teacher, compiled split` and `scorer, compiled split`: each head's share of the best split averaged over
  calibration prompts (`austen-repeats`, another seed), applied to the held-out prompt: what head budgets compiled
  offline gain.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.distilled.lookahead_probe import scorer_scores, student_scores
from benchmarks.distilled.student_features import RATIOS, SINKS, WINDOW, held_out_texts, paired_rows
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import REPEATING_CORPUS, calibration_prompts, load_corpus
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import prefill_features_and_targets
from kvruntime.methods.distilled import DistilledScorer
from kvruntime.requests.request import kept_per_head


def head_mass(log_scores: torch.Tensor) -> torch.Tensor:
    """[Hkv, N] teacher log-scores -> each head's distribution over the tokens a cut may drop (sinks, window out)."""
    mass = log_scores[:, SINKS:-WINDOW].double().exp()
    return mass / mass.sum(-1, keepdim=True)


def mass_held(mass: torch.Tensor, scores: torch.Tensor, counts: list[int]) -> float:
    """The mass [Hkv, n] the top `counts[h]` of each head's `scores` [Hkv, n] hold, summed over heads."""
    return sum(float(mass[h, scores[h].topk(c).indices].sum()) for h, c in enumerate(counts))


def best_split(mass: torch.Tensor, k: int) -> list[int]:
    """How many entries each head gets when the layer's Hkv * k go to the largest masses over all its heads."""
    heads, length = mass.shape
    chosen = mass.flatten().topk(heads * k).indices // length
    return torch.bincount(chosen, minlength=heads).tolist()


def compiled_split(shares: torch.Tensor, k: int) -> list[int]:
    """Hkv * k entries split by `shares` [Hkv] (largest remainders), each head at least 1."""
    total = shares.shape[0] * k
    exact = shares / shares.sum() * total
    counts = exact.floor().long().clamp(min=1)
    for h in (exact - exact.floor()).argsort(descending=True)[: max(0, total - int(counts.sum()))]:
        counts[h] += 1
    return counts.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per text type")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--calibration", type=int, default=8, help="calibration prompts the compiled split averages")
    parser.add_argument("--out", default="benchmarks/distilled/head_budgets_probe.md")
    args = parser.parse_args()
    started = time.time()
    model, tokenizer = kvruntime.load_model(args.model)
    scorer = DistilledScorer.from_artifact(
        kvruntime.load_artifact(default_artifact(args.model, "distilled_scorer"), model=model)
    )

    def prompt_scores(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's log-scores and the scorer's (the student averaged with its lookahead queries), [L, Hkv, N]."""
        cache, features, targets = prefill_features_and_targets(model, tokenizer, ids, scorer.oracle)
        return targets.float(), scorer_scores(model, cache, student_scores(features, scorer), scorer)

    splits: dict[float, list[torch.Tensor]] = {ratio: [] for ratio in RATIOS}  # per ratio: [L, Hkv] shares
    calibration = calibration_prompts(load_corpus(REPEATING_CORPUS), tokenizer, args.calibration, args.tokens, seed=9)
    for _, ids in tqdm(calibration, desc="calibration"):
        targets, _ = prompt_scores(ids)
        for ratio in RATIOS:
            k = kept_per_head(ids.shape[1], WINDOW, ratio=ratio) - WINDOW - SINKS
            shares = [torch.tensor(best_split(head_mass(t), k), dtype=torch.float64) / k for t in targets]
            splits[ratio].append(torch.stack(shares))
    compiled = {ratio: torch.stack(shares).mean(0) for ratio, shares in splits.items()}
    captured: dict[tuple[str, str, float], list[float]] = {}
    for text, corpus in held_out_texts().items():
        for _, ids in tqdm(calibration_prompts(corpus, tokenizer, args.prompts, args.tokens, 7), desc=text):
            targets, scores = prompt_scores(ids)
            for ratio in RATIOS:
                k = kept_per_head(ids.shape[1], WINDOW, ratio=ratio) - WINDOW - SINKS
                held: dict[str, list[float]] = {}
                for layer, (target, score) in enumerate(zip(targets, scores)):
                    mass, score = head_mass(target), score[:, SINKS:-WINDOW]
                    uniform, best = [k] * mass.shape[0], best_split(mass, k)
                    split = compiled_split(compiled[ratio][layer], k)
                    own = mass_held(mass, mass, uniform)
                    for name, value in (
                        ("scorer", mass_held(mass, score, uniform)),
                        ("teacher, best split", mass_held(mass, mass, best)),
                        ("teacher, compiled split", mass_held(mass, mass, split)),
                        ("scorer, compiled split", mass_held(mass, score, split)),
                    ):
                        held.setdefault(name, []).append(value / own)
                for name, values in held.items():
                    captured.setdefault((text, name, ratio), []).append(sum(values) / len(values))
    rows = paired_rows(captured, "scorer", "variant", "minus_scorer")
    markdown = "\n".join(
        [
            f"# The teacher gap split: within-head selection and across-head allocation, {args.model} (issue #74)",
            "",
            *run_header(),
            f"Ran for {time.time() - started:.0f} s. "
            f"{args.prompts} held-out prompts of {args.tokens} tokens per type; compiled split from {args.calibration} "
            "`austen-repeats` prompts. `captured`: the teacher's mass held over its own top-k per head's (1 for "
            "the teacher with the same count in every head).",
            "",
            *markdown_table(rows),
            "",
        ]
    )
    write_results(rows, Path(args.out), markdown)


if __name__ == "__main__":
    main()
