"""Learned lookahead queries against the one-pass student, per text type (issue #74).

    python -m benchmarks.distilled.lookahead_probe [--model default] [--queries 16] [--steps 400]

n input embeddings are appended after a prefilled context (the model frozen, the context without gradient) and
trained so that their attention over the context, per (layer the runtime cuts, KV head), matches the teacher's
scores (`kvcompile distill`'s reconstruction oracle) in KL. Measured as `student_features.py` measures: the teacher's
score mass each head's top-k holds over the teacher's own top-k's, at 0.5 / 0.75 / 0.9, on held-out prompts per text
type, for the shipped student, the lookahead queries alone and the mean of both log-scores, paired with the student.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.distilled.student_features import RATIOS, WINDOW, captured_mass, held_out_texts, paired_rows
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import REPEATING_CORPUS, calibration_prompts, load_corpus
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import prompt_features_and_targets
from kvcompile.recipes.distilled.lookahead import appended_log_scores, kl_from_oracle, prefilled
from kvruntime.methods.distilled import DistilledScorer
from kvruntime.methods.distilled.method import lookahead_log_scores, with_lookahead_scores
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.second_pass import lookahead_attention


def student_scores(features: list[torch.Tensor], scorer: DistilledScorer) -> torch.Tensor:
    return torch.einsum("lnf,lfh->lhn", torch.stack([f.float() for f in features]), scorer.weights)


def scorer_scores(
    model: torch.nn.Module, cache: object, student: torch.Tensor, scorer: DistilledScorer
) -> torch.Tensor:
    """The shipped scorer's log-scores [L, Hkv, N] of a prompt prefilled in `cache`, as the runtime makes them: the
    `student`'s (`student_scores`) with its lookahead queries' where it has them."""
    if scorer.lookahead_queries is None:
        return student
    means = lookahead_attention(model, cache, scorer.lookahead_queries, student.shape[-1])
    lookahead = torch.stack([lookahead_log_scores(mean, student.shape[1])[0] for mean in means])
    return with_lookahead_scores(student, lookahead)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--train-prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per text type")
    parser.add_argument("--residual", action="store_true", help="train the sum of the student's and their scores")
    parser.add_argument("--out", default="benchmarks/distilled/lookahead_probe.md")
    args = parser.parse_args()
    started = time.time()
    model, tokenizer = kvruntime.load_model(args.model)
    model.set_attn_implementation("eager")
    model.requires_grad_(False)
    scorer = DistilledScorer.from_artifact(
        kvruntime.load_artifact(default_artifact(args.model, "distilled_scorer"), model=model)
    )
    layers = list(model_layout(model).cut_layers)
    training = []
    for _, ids in tqdm(
        calibration_prompts(load_corpus(REPEATING_CORPUS), tokenizer, args.train_prompts, args.tokens, seed=5),
        desc="teacher",
    ):
        features, targets = prompt_features_and_targets(model, tokenizer, ids, scorer.oracle)
        student = student_scores(features, scorer) if args.residual else torch.zeros_like(targets).float()
        training.append((prefilled(model, ids), targets.float(), ids.shape[1], student))
    generator = torch.Generator().manual_seed(0)
    table = model.get_input_embeddings()
    start_ids = torch.randint(0, table.num_embeddings, (args.queries,), generator=generator)
    with torch.no_grad():
        initial = table(start_ids).float()
    scale = float(initial.pow(2).mean().sqrt())
    delta = torch.zeros_like(initial, requires_grad=True)
    optimizer = torch.optim.Adam([delta], lr=args.lr * scale)
    losses = []
    for step in tqdm(range(args.steps), desc="training"):
        cache, targets, length, student = training[step % len(training)]
        scores = student + appended_log_scores(model, cache, initial + delta, length, layers)
        loss = kl_from_oracle(scores, targets, WINDOW)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    trained = (initial + delta).detach()
    del training
    texts = held_out_texts()
    captured: dict[tuple[str, str, float], list[float]] = {}
    for text, corpus in texts.items():
        for _, ids in tqdm(calibration_prompts(corpus, tokenizer, args.prompts, args.tokens, 7), desc=text):
            features, targets = prompt_features_and_targets(model, tokenizer, ids, scorer.oracle)
            student = student_scores(features, scorer)
            cache = prefilled(model, ids)
            with torch.no_grad():
                untrained = appended_log_scores(model, cache, initial, ids.shape[1], layers)
                lookahead = appended_log_scores(model, cache, trained, ids.shape[1], layers)
            predictions = {
                "student": student,
                "lookahead, untrained": untrained,
                "lookahead": lookahead,
                "mean of student and lookahead": with_lookahead_scores(student, lookahead),
                "student plus lookahead": student + lookahead,
            }
            for name, scores in predictions.items():
                for ratio in RATIOS:
                    per_layer = [captured_mass(scores[i], targets[i], ratio) for i in range(len(layers))]
                    captured.setdefault((text, name, ratio), []).append(sum(per_layer) / len(layers))
    rows = paired_rows(captured, "student", "scores", "minus_student")
    markdown = "\n".join(
        [
            f"# Lookahead queries against the student, {args.model} (issue #74)",
            "",
            *run_header(),
            f"Ran for {time.time() - started:.0f} s. "
            f"{args.queries} queries trained {args.steps} steps on {args.train_prompts} `austen-repeats` prompts of "
            f"{args.tokens} tokens{', on the sum of its and the student' + chr(39) + 's log-scores' if args.residual else ''}; KL to the teacher {losses[0]:.3f} at the first step, "
            f"{sum(losses[-len(losses) // 10 :]) / max(1, len(losses) // 10):.3f} over the last tenth.",
            "",
            *markdown_table(rows),
            "",
        ]
    )
    write_results(rows, Path(args.out), markdown)


if __name__ == "__main__":
    main()
