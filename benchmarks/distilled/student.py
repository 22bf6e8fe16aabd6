"""Is the linear student what limits the distilled scorer? A small MLP per layer against ridge, on the same tokens.

    python -m benchmarks.distilled.student [--prompts 16] [--tokens-per-prompt 512] [--hidden 64] [--steps 600]

Training tokens: a seeded sample of tokens from calibration prompts of `austen-repeats` (the corpus `kvcompile
distill` reads), their features (`token_features`) and the oracle's log-scores (the context fed again after itself).
Per layer, on the same sample: ridge regression (the strength chosen on a held-out tenth), and the same ridge map
plus an MLP fitted to its residual (features standardised, one hidden layer, GELU, output started at zero, Adam on
the squared error of the log-scores, the step with the least held-out error kept: at worst the ridge map). Beside them, the shipped scorer (ridge on every token of 32 prompts). Scored as `fit.py`
scores, on the same held-out text: rank correlation with the oracle and top-k overlap at 10%, 25%, 50% kept.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.distilled.fit import KEPT, spearman, top_overlap
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import (
    REPEATING_CORPUS,
    Corpus,
    calibration_prompts,
    load_corpus,
    repeating_documents,
)
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import ALPHAS, prompt_features_and_targets, ridge
from kvruntime.methods.distilled import DistilledScorer


def training_sample(model, tokenizer, prompts: int, per_prompt: int, oracle: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [L, T, F] and log-scores [L, T, Hkv] of `per_prompt` seeded tokens of each calibration prompt."""
    generator = torch.Generator().manual_seed(0)
    xs, ys = [], []
    calibration = calibration_prompts(load_corpus(REPEATING_CORPUS), tokenizer, prompts, 2048, seed=0)
    for _, ids in tqdm(calibration, desc="training prompts", unit="prompt"):
        features, targets = prompt_features_and_targets(model, tokenizer, ids, oracle)
        chosen = torch.randperm(ids.shape[1], generator=generator)[:per_prompt]
        xs.append(torch.stack([x[chosen].float() for x in features]))
        ys.append(targets[:, :, chosen].transpose(1, 2).float())
    return torch.cat(xs, dim=1), torch.cat(ys, dim=1)


def fit_ridge(x: torch.Tensor, y: torch.Tensor, held_out: int) -> torch.Tensor:
    """Ridge weights [F, H], the strength of least error on the last `held_out` tokens, refitted on all."""
    x, y = x.double(), y.double()
    fit_x, fit_y, out_x, out_y = x[:-held_out], y[:-held_out], x[-held_out:], y[-held_out:]
    gram, cross = fit_x.T @ fit_x, fit_x.T @ fit_y
    errors = [float(((out_x @ ridge(gram, cross, a) - out_y) ** 2).mean()) for a in ALPHAS]
    return ridge(x.T @ x, x.T @ y, ALPHAS[errors.index(min(errors))]).float()


def fit_mlp(
    x: torch.Tensor, y: torch.Tensor, linear: torch.Tensor, held_out: int, hidden: int, steps: int
) -> torch.nn.Module:
    """The ridge map plus a one-hidden-layer MLP on standardised features fitted to its residual (output layer
    started at zero: the student starts as the ridge one), full-batch Adam, the step of least held-out error."""
    torch.manual_seed(0)
    mean, std = x[:-held_out].mean(dim=0), x[:-held_out].std(dim=0).clamp(min=1e-6)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(), torch.nn.Linear(hidden, y.shape[1]))
    torch.nn.init.zeros_(net[2].weight)
    torch.nn.init.zeros_(net[2].bias)
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-4)
    residual = y - x @ linear
    fit_x, fit_y = (x[:-held_out] - mean) / std, residual[:-held_out]
    out_x, out_y = (x[-held_out:] - mean) / std, residual[-held_out:]
    best, best_state = float("inf"), None
    for _ in range(steps):
        with torch.no_grad():
            error = float(((net(out_x) - out_y) ** 2).mean())
        if error < best:
            best, best_state = error, {k: v.clone() for k, v in net.state_dict().items()}
        optimiser.zero_grad()
        ((net(fit_x) - fit_y) ** 2).mean().backward()
        optimiser.step()
    net.load_state_dict(best_state)
    return ResidualStudent(linear, mean, std, net).eval()


class ResidualStudent(torch.nn.Module):
    def __init__(self, linear: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, net: torch.nn.Module) -> None:
        super().__init__()
        self.linear, self.mean, self.std, self.net = linear, mean, std, net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.linear + self.net((x - self.mean) / self.std)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens-per-prompt", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--scorer", default=str(default_artifact("default", "distilled_scorer")))
    parser.add_argument("--out", default="benchmarks/distilled/distilled_student.md")
    args = parser.parse_args()
    model, tokenizer = kvruntime.load_model("default")
    scorer = DistilledScorer.from_artifact(kvruntime.load_artifact(args.scorer, model=model))
    x, y = training_sample(model, tokenizer, args.prompts, args.tokens_per_prompt, scorer.oracle)
    held_out = x.shape[1] // 10
    students: dict[str, list] = {"ridge (sample)": [], "ridge + mlp (sample)": []}
    for layer in tqdm(range(x.shape[0]), desc="fitting", unit="layer"):
        linear = fit_ridge(x[layer], y[layer], held_out)
        students["ridge (sample)"].append(linear)
        students["ridge + mlp (sample)"].append(fit_mlp(x[layer], y[layer], linear, held_out, args.hidden, args.steps))
    students["ridge (shipped, every token)"] = list(scorer.weights)

    def predict(student: object, features: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = student(features) if isinstance(student, torch.nn.Module) else features @ student
        return out.T  # [Hkv, N]

    book = load_corpus("moby-dick")
    repeating = Corpus("moby-dick-repeats", tuple(repeating_documents(book.documents, documents=1, seed=7)))
    held_out_prompts = [("Moby-Dick", ids) for _, ids in calibration_prompts(book, tokenizer, 8, 2048, 7)]
    held_out_prompts += [
        ("Moby-Dick repeating", ids) for _, ids in calibration_prompts(repeating, tokenizer, 4, 2048, 7)
    ]
    metrics: dict[tuple[str, str, int], list[list[float]]] = {}
    for text, ids in tqdm(held_out_prompts, desc="held-out prompts", unit="prompt"):
        features, targets = prompt_features_and_targets(model, tokenizer, ids, scorer.oracle)
        for name, layers in students.items():
            for layer, student in enumerate(layers):
                scores, target = predict(student, features[layer].float()), targets[layer].float()
                row = [float(spearman(scores, target).mean())]
                row += [float(top_overlap(scores, target, share).mean()) for share in KEPT]
                metrics.setdefault((text, name, layer), []).append(row)
    per_layer = {key: [statistics.mean(column) for column in zip(*values)] for key, values in metrics.items()}
    rows = []
    for text, name in dict.fromkeys((text, name) for text, name, _ in per_layer):
        layers = [v for (t, n, _), v in per_layer.items() if (t, n) == (text, name)]
        means = [round(statistics.mean(column), 3) for column in zip(*layers)]
        rows.append(
            {"text": text, "student": name, "spearman": means[0]}
            | {f"top{int(share * 100)}_overlap": m for share, m in zip(KEPT, means[1:])}
            | {"worst_layer_spearman": round(min(v[0] for v in layers), 3)}
        )
    markdown = "\n".join(
        [
            "# Distilled scorer: a small MLP against the linear student",
            "",
            *run_header(),
            f"Trained per layer on "
            f"{x.shape[1]} tokens ({args.tokens_per_prompt} from each of {args.prompts} `austen-repeats` prompts of "
            "2,048 tokens); scored on 8 Moby-Dick passages and 4 of Moby-Dick's sentences repeated (2,048 tokens), "
            "mean over layers, KV heads and prompts.",
            "",
            *markdown_table(rows),
            "",
        ]
    )
    write_results(rows, Path(args.out), markdown)


if __name__ == "__main__":
    main()
