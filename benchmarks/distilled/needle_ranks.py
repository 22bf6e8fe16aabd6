"""Where an answer in prose goes: how many of its tokens each score keeps, per model (issue #74).

    python -m benchmarks.distilled.needle_ranks [--model gemma-3-270m] [--prompts 8] [--tokens 2048] [--task multikey]

On pass-key prompts in Moby-Dick (the eval's `passkey_prose`, fresh seeds; `--task multikey`: the asked key's value in
the eval's multi-key prompts), context only (question-agnostic), the share of the key's tokens that each (layer the
runtime cuts, KV head) keeps in its top-k at 0.5 and 0.75 (the last 16 tokens and the first kept by every score),
under: the three teachers `kvcompile distill` can distill (reconstruction, the one the shipped student imitates;
repeat; KVzip+), the student, the student with its lookahead queries (when the scorer holds them: the mean of both
log-scores), the key's leverage among the layer's keys (Compactor's outlier term) and the student plus that leverage.
Beside it, the teacher's mass on the key's tokens over a uniform share, and the normalised entropy of the teacher's
distribution (1: flat), which say whether the teacher itself singles the key out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.distilled.lookahead_probe import scorer_scores, student_scores
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import load_corpus
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import prompt_features_and_targets
from kvcompile.recipes.distilled.lookahead import prefilled
from kvcompile.tasks.retrieval import retrieval_prompt
from kvruntime.math.selection import protect_sinks, protect_window
from kvruntime.methods.distilled import ORACLES, DistilledScorer
from kvruntime.methods.distilled.leverage import key_leverage
from kvruntime.models.layout import model_layout
from kvruntime.requests.request import kept_per_head

RATIOS = (0.5, 0.75)
WINDOW, SINKS = 16, 1


def key_positions(tokenizer, context: str, key: str) -> tuple[torch.Tensor, list[int]]:
    encoded = tokenizer(context, return_offsets_mapping=True)
    spans = []
    start = context.find(key)
    while start >= 0:
        spans.append((start, start + len(key)))
        start = context.find(key, start + 1)
    positions = [
        i for i, (a, b) in enumerate(encoded.offset_mapping) if b > a and any(a < e and b > s for s, e in spans)
    ]
    return torch.tensor([encoded.input_ids]), positions


def kept_share(scores: torch.Tensor, positions: list[int], ratio: float) -> float:
    """Share of `positions` inside each head's top-k of [Hkv, N] scores, mean over heads."""
    length = scores.shape[-1]
    protected = protect_sinks(protect_window(scores[None].float(), WINDOW), SINKS)[0]
    top = protected.topk(kept_per_head(length, WINDOW, ratio=ratio), dim=-1).indices
    inside = torch.zeros_like(protected, dtype=torch.bool).scatter_(-1, top, True)
    return float(inside[:, positions].float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--task", default="passkey_prose", choices=("passkey_prose", "multikey"))
    parser.add_argument("--scorer", default=None, help="a distilled_scorer (default: the model's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.time()
    model, tokenizer = kvruntime.load_model(args.model)
    scorer = DistilledScorer.from_artifact(
        kvruntime.load_artifact(args.scorer or default_artifact(args.model, "distilled_scorer"), model=model)
    )
    layers = list(model_layout(model).cut_layers)
    corpus = load_corpus("moby-dick")
    kept: dict[tuple[str, float], list[float]] = {}
    lifts, entropies = [], []
    for sample in tqdm(range(args.prompts), desc="prompts"):
        depth = (sample + 0.5) / args.prompts
        task = retrieval_prompt(args.task, corpus, tokenizer, args.tokens, depth, seed=60 + sample, chat=False)
        ids, positions = key_positions(tokenizer, task.prompt[: task.question_start], task.expected[0])
        features, targets = prompt_features_and_targets(model, tokenizer, ids, scorer.oracle)
        student = student_scores(features, scorer)
        cache = prefilled(model, ids)
        leverage = torch.stack([key_leverage(cache.layers[i].keys)[0].log() for i in layers])
        scores = {f"teacher: {scorer.oracle}": targets.float()}
        for oracle in ORACLES:
            if oracle != scorer.oracle:
                scores[f"teacher: {oracle}"] = prompt_features_and_targets(model, tokenizer, ids, oracle)[1].float()
        scores["student"] = student
        if scorer.lookahead_queries is not None:
            scores["student with its lookahead queries"] = scorer_scores(model, cache, student, scorer)
        scores.update(
            {
                "key leverage": leverage,
                "student + 2 x leverage": student + 2 * leverage,
            }
        )
        for name, layer_scores in scores.items():
            for ratio in RATIOS:
                per_layer = [kept_share(s, positions, ratio) for s in layer_scores]
                kept.setdefault((name, ratio), []).append(sum(per_layer) / len(per_layer))
        teacher = targets.float()[..., SINKS:-WINDOW].softmax(dim=-1)  # the student's teacher
        inner = [p - SINKS for p in positions]
        lifts.append(float(teacher[..., inner].mean() * teacher.shape[-1]))
        entropies.append(
            float(
                (
                    -(teacher * teacher.clamp(min=1e-30).log()).sum(-1)
                    / torch.log(torch.tensor(float(teacher.shape[-1])))
                ).mean()
            )
        )
    rows = [
        {"scores": name, "ratio": ratio, "key_tokens_kept": round(sum(v) / len(v), 3), "prompts": len(v)}
        for (name, ratio), v in kept.items()
    ]
    out = Path(args.out or f"benchmarks/distilled/needle_ranks_{args.model}.md")
    markdown = "\n".join(
        [
            f"# The answer in prose ({args.task}): its tokens kept per score, {args.model} (issue #74)",
            "",
            *run_header(),
            f"Ran for {time.time() - started:.0f} s. "
            f"{args.prompts} `{args.task}` contexts of {args.tokens} tokens (seeds 60-{59 + args.prompts}); "
            f"{len(layers)} layers cut, {scorer.weights.shape[-1]} KV heads each. The teacher's mass on the key's "
            f"tokens over a uniform share: {sum(lifts) / len(lifts):.2f}x; the teacher's normalised entropy "
            f"{sum(entropies) / len(entropies):.3f} (1: flat).",
            "",
            *markdown_table(rows),
            "",
        ]
    )
    write_results(rows, out, markdown)


if __name__ == "__main__":
    main()
