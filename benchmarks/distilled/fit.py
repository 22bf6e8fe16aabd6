"""How well the distilled scorer ranks tokens like the second pass it was distilled from, on held-out text.

    python -m benchmarks.distilled.fit [--prompts 8] [--repeating-prompts 4] [--tokens 2048] [--scorer PATH]

Held-out prompts: passages of Moby-Dick, and passages of a document in which Moby-Dick's sentences repeat
(`repeating_documents`, as the `austen-repeats` calibration corpus is built from Austen). Per layer, averaged over KV heads and
prompts: Spearman rank correlation with the oracle's scores (the context fed again after itself, as `kvcompile
distill` and `kvcompose:mode=dynamic` score), and top-k overlap (|top-k predicted & top-k oracle| / k) at 10%, 25%
and 50% of the context kept. Beside it, the one-pass window scores of kvcompose's compiled mode (the last 32 queries'
attention maxima): what a single pass gives without distillation.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.reporting import run_header, write_results
from kvcompile.calibration.corpus import Corpus, calibration_prompts, load_corpus, repeating_documents
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import prompt_features_and_targets
from kvruntime.methods import KVCompose
from kvruntime.methods.distilled import DistilledScorer, predicted_scores
from kvruntime.plumbing.attention import captured_logits
from kvruntime.plumbing.window import query_hooks, window_attention

KEPT = (0.1, 0.25, 0.5)


def ranks(scores: torch.Tensor) -> torch.Tensor:
    return scores.argsort(dim=-1).argsort(dim=-1).double()


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rank correlation along the last dimension (ties broken by position)."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(dim=-1, keepdim=True), rb - rb.mean(dim=-1, keepdim=True)
    return (ra * rb).sum(dim=-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def top_overlap(a: torch.Tensor, b: torch.Tensor, share: float) -> torch.Tensor:
    k = max(1, round(share * a.shape[-1]))
    top_a = torch.zeros_like(a, dtype=torch.bool).scatter(-1, a.topk(k, dim=-1).indices, True)
    top_b = torch.zeros_like(b, dtype=torch.bool).scatter(-1, b.topk(k, dim=-1).indices, True)
    return (top_a & top_b).sum(dim=-1).double() / k


def window_scores(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """kvcompose's compiled-mode token scores from one prefill: [L, Hkv, N]."""
    method, layers = KVCompose(mode="dynamic"), {}

    def keep(layer, module, queries, keys, values, *_):
        attention = window_attention(queries, keys, captured_logits(module))
        layers[layer] = method.token_scores(attention, layer)[0]

    with query_hooks(model, keep, window=method.window), torch.no_grad():
        model.base_model(input_ids=ids, use_cache=True)
    return torch.stack([layers[i] for i in sorted(layers)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeating-prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--scorer", default=str(default_artifact("default", "distilled_scorer")))
    parser.add_argument("--out", default="benchmarks/distilled/distilled_fit.md")
    args = parser.parse_args()
    model, tokenizer = kvruntime.load_model("default")
    scorer = DistilledScorer.from_artifact(kvruntime.load_artifact(args.scorer, model=model))
    book = load_corpus("moby-dick")
    repeating = Corpus("moby-dick-repeats", tuple(repeating_documents(book.documents, documents=1, seed=7)))
    prompts = [("Moby-Dick", ids) for _, ids in calibration_prompts(book, tokenizer, args.prompts, args.tokens, 7)]
    prompts += [
        ("Moby-Dick repeating", ids)
        for _, ids in calibration_prompts(repeating, tokenizer, args.repeating_prompts, args.tokens, 7)
    ]
    metrics: dict[tuple[str, str, int], list[list[float]]] = {}
    for text, ids in tqdm(prompts, desc="held-out prompts", unit="prompt"):
        features, targets = prompt_features_and_targets(model, tokenizer, ids, scorer.oracle)
        student = torch.stack(
            [predicted_scores(x[None], scorer.weights[i].double())[0] for i, x in enumerate(features)]
        )
        for name, scores in (("distilled", student), ("window (one pass)", window_scores(model, ids).double())):
            for layer in range(targets.shape[0]):
                row = [float(spearman(scores[layer], targets[layer]).mean())]
                row += [float(top_overlap(scores[layer], targets[layer], share).mean()) for share in KEPT]
                metrics.setdefault((text, name, layer), []).append(row)
    rows = []
    for (text, name, layer), values in metrics.items():
        means = [statistics.mean(column) for column in zip(*values)]
        rows.append(
            {"text": text, "scores": name, "layer": layer, "spearman": round(means[0], 3)}
            | {f"top{int(share * 100)}_overlap": round(m, 3) for share, m in zip(KEPT, means[1:])}
        )
    summary = []
    for text, name in dict.fromkeys((r["text"], r["scores"]) for r in rows):
        chosen = [r for r in rows if (r["text"], r["scores"]) == (text, name)]
        summary.append(
            f"| {text} | {name} | "
            + " | ".join(f"{statistics.mean(r[c] for r in chosen):.3f}" for c in list(chosen[0])[3:])
            + f" | {min(r['spearman'] for r in chosen):.3f} |"
        )
    columns = list(rows[0])[3:]
    markdown = "\n".join(
        [
            "# Distilled scorer: ranking quality on held-out text",
            "",
            *run_header(),
            f"{args.prompts} Moby-Dick "
            f"passages and {args.repeating_prompts} passages of Moby-Dick's sentences repeated, {args.tokens} tokens "
            f"each (calibration: Austen, `austen-repeats`); scorer oracle: {scorer.oracle}. Mean over layers (per-layer rows in the "
            "CSV), each layer averaged over KV heads and prompts.",
            "",
            "| text | scores | " + " | ".join(columns) + " | worst layer spearman |",
            "|---" * (len(columns) + 3) + "|",
            *summary,
            "",
        ]
    )
    write_results(rows, Path(args.out), markdown)


if __name__ == "__main__":
    main()
