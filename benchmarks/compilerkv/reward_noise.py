"""How noisy is CompilerKV's paired reward, and how much experience does an action's effect need to be seen?
Measured on calibration prompts with every state probed on every prompt (no sampling), under the ratio-honest rule.

    python -m benchmarks.compilerkv.reward_noise [--prompts 16] [--budgets 256,512] [--utilities global,head]
        [--losses nll,kl] [--continuations corpus,greedy]

Per prompt and budget, from neutral tables (W_head = 1, every threshold 0.9): the base rollout, then
- head probes: each query head of each layer given weight 1.5, the others 1.0;
- gate probes: each layer's threshold set to 0.8, and to 1.0, the others 0.9.
Paired reward = base loss - probe loss (positive: the probe helps); the loss is the continuation's mean NLL (the
paper's) or its mean KL divergence from the full cache's next-token distributions (`--losses kl`: the same
expectation over the vocabulary instead of one realised token), on the corpus's continuation or on the model's own
greedy one (`--continuations greedy`). Per state: the mean over prompts, the standard
deviation over prompts (the noise of one record) and t = mean / standard error. Split half: the correlation over
states of the mean reward on the even and on the odd prompts (0 if the states' differences are noise). Sizing: the
prompts per state that a two-sided 5% test with 80% power needs to see an effect d: n = (2.8 * sd / d)^2.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import calibration_prompts, load_corpus
from kvcompile.evaluation.metrics import bootstrap_interval
from kvcompile.recipes.compilerkv.bandit_experience import gate_fallback
from kvcompile.recipes.compilerkv.continuation_nll import ContinuationScorer
from kvcompile.recipes.compilerkv.experience_collection import (
    SelectionRule,
    greedy_continuation,
    kept_sets,
    prefill_prompt,
    variant_nlls,
)
from kvruntime.methods.compilerkv import layer_scores

NEUTRAL_THRESHOLD = gate_fallback(elastic=False)  # the middle of the threshold grid
RAISED_WEIGHT = 1.5
PROBED_THRESHOLDS = (0.8, 1.0)


def probes(signals, layers: int, heads: int, utility: str) -> list[tuple[str, tuple, list[torch.Tensor], list]]:
    """(kind, state, scores per layer, thresholds) of every probe, from neutral tables."""
    neutral = [layer_scores(signals, layer, torch.ones(heads), utility) for layer in range(layers)]
    thresholds = [NEUTRAL_THRESHOLD] * layers
    found = [("base", (), neutral, thresholds)]
    for layer in range(layers):
        for head in range(heads):
            weights = torch.ones(heads)
            weights[head] = RAISED_WEIGHT
            varied = list(neutral)
            varied[layer] = layer_scores(signals, layer, weights, utility)
            found.append(("head", (layer, head), varied, thresholds))
        for threshold in PROBED_THRESHOLDS:
            varied_thresholds = list(thresholds)
            varied_thresholds[layer] = threshold
            found.append(("gate", (layer, threshold), neutral, varied_thresholds))
    return found


def measure(model, prompt, budget: int, utility: str, batch_size: int, loss: str, continuation: str) -> list[dict]:
    """One prompt's paired rewards for every probe at one budget (probes that keep what the base keeps: 0)."""
    layers, heads = len(prompt.signals.rho), model.config.num_attention_heads
    rule = SelectionRule(elastic=False, utility=utility)
    found = probes(prompt.signals, layers, heads, utility)
    kept = [kept_sets(scores, thresholds, budget, rule) for _, _, scores, thresholds in found]
    scorer = ContinuationScorer(model, prompt.prefilled, batch_size, loss=loss)
    base = scorer.base(kept[0])
    changed = [i for i in range(1, len(found)) if any(not torch.equal(a, b) for a, b in zip(kept[i], kept[0]))]
    nll = dict(enumerate(variant_nlls(scorer, base, kept[1:], prompt.index), start=1))
    return [
        dict(
            utility=utility,
            loss=loss,
            continuation=continuation,
            budget=budget,
            prompt=prompt.index,
            kind=kind,
            layer=state[0],
            action=state[1],
            changed=int(i in changed),
            reward=base.loss - nll[i],
            base_increase=base.loss - (prompt.full_nll if loss == "nll" else 0.0),  # the full cache's KL is 0
        )
        for i, (kind, state, _, _) in enumerate(found)
        if kind != "base"
    ]


def summarise(rows: list[dict]) -> list[dict]:
    table = []
    fields = ("utility", "loss", "continuation", "kind", "budget")
    for group in sorted({tuple(r[f] for f in fields) for r in rows}):
        utility, loss, continuation, kind, budget = group
        cell = [r for r in rows if tuple(r[f] for f in fields) == group]
        states = sorted({(r["layer"], r["action"]) for r in cell})
        by_state = {s: {} for s in states}
        for r in cell:
            by_state[(r["layer"], r["action"])][r["prompt"]] = r["reward"]
        prompts = sorted({r["prompt"] for r in cell})
        rewards = np.array([[by_state[s][p] for p in prompts] for s in states])  # [states, prompts]
        means, sds = rewards.mean(axis=1), rewards.std(axis=1, ddof=1)
        moving = sds > 0  # states whose probe changed a kept set on some prompt
        t = np.where(moving, means / np.where(moving, sds, 1) * np.sqrt(len(prompts)), 0.0)
        even, odd = rewards[:, 0::2].mean(axis=1), rewards[:, 1::2].mean(axis=1)
        split = float(np.corrcoef(even[moving], odd[moving])[0, 1]) if moving.sum() > 2 else float("nan")
        effect = float(np.median(np.abs(means[moving]))) if moving.any() else float("nan")
        sd = float(np.median(sds[moving])) if moving.any() else float("nan")
        table.append(
            {
                "utility": utility,
                "loss": loss,
                "continuation": continuation,
                "probe": kind,
                "budget": budget,
                "prompts": len(prompts),
                "states": len(states),
                "probes changing the kept sets": f"{statistics.mean(r['changed'] for r in cell):.0%}",
                "median sd over prompts": f"{sd:.5f}",
                "median abs mean effect": f"{effect:.5f}",
                "moving states with abs t > 2": f"{float((np.abs(t[moving]) > 2).mean()) if moving.any() else float('nan'):.0%} (chance 5%)",
                "split-half r of state means": f"{split:.2f}",
                "prompts per state to see the median effect": f"{(2.8 * sd / effect) ** 2:.0f}",
                "prompts per state to see 0.0005": f"{(2.8 * sd / 0.0005) ** 2:.0f}",
            }
        )
    return table


def utility_rows(rows: list[dict]) -> list[dict]:
    """The neutral tables' NLL increase over the full cache per utility, and the head-aware minus the spec's (on the
    corpus's continuations)."""
    rows = [r for r in rows if r["loss"] == "nll" and r["continuation"] == "corpus"]
    increase = {(r["utility"], r["budget"], r["prompt"]): r["base_increase"] for r in rows}
    out = []
    for budget in sorted({r["budget"] for r in rows}):
        prompts = sorted({r["prompt"] for r in rows if r["budget"] == budget})
        row = {"budget": budget, "prompts": len(prompts)}
        for utility in sorted({r["utility"] for r in rows}):
            row[f"NLL increase, {utility} utility"] = (
                f"{np.mean([increase[(utility, budget, p)] for p in prompts]):+.4f}"
            )
        if {"global", "head"} <= {r["utility"] for r in rows}:
            differences = [increase[("head", budget, p)] - increase[("global", budget, p)] for p in prompts]
            low, high = bootstrap_interval(differences)
            row["head minus global (95% bootstrap)"] = f"{np.mean(differences):+.4f} ({low:+.4f} to {high:+.4f})"
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--budgets", default="256,512")
    parser.add_argument("--utilities", default="global,head")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--corpus", default="austen")
    parser.add_argument("--losses", default="nll", help="nll, kl (comma-separated)")
    parser.add_argument("--continuations", default="corpus", help="corpus, greedy (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/compilerkv/compilerkv_reward_noise.md")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    utilities, losses, continuations = (text.split(",") for text in (args.utilities, args.losses, args.continuations))
    model, tokenizer = kvruntime.load_model()
    texts = calibration_prompts(
        load_corpus(args.corpus), tokenizer, args.prompts, args.context + args.continuation, args.seed
    )
    rows = []
    units = len(texts) * len(budgets) * len(utilities) * len(losses) * len(continuations)
    bar = tqdm(total=units, desc="reward noise", unit="unit")
    for index, (_, ids) in enumerate(texts):
        for continuation in continuations:
            if continuation == "greedy":  # the full-cache model's own continuation of the context
                ids = greedy_continuation(model, ids, args.context, args.continuation)
            prompt = prefill_prompt(model, ids, args.context, index)
            for utility, budget, loss in itertools.product(utilities, budgets, losses):
                rows += measure(model, prompt, budget, utility, args.batch_size, loss, continuation)
                bar.update()
    bar.close()
    lines = [
        "# CompilerKV: the noise of a paired reward, and the experience an effect needs (default model)",
        "",
        *run_header(),
        f"{args.prompts} `{args.corpus}` "
        f"prompts of {args.context} tokens + {args.continuation} continuation; ratio-honest rule; every state probed "
        f"on every prompt from neutral tables (W_head = 1, thresholds {NEUTRAL_THRESHOLD:.2f}): head probes raise one "
        f"query head's weight to {RAISED_WEIGHT}, gate probes set one layer's threshold to "
        f"{' or '.join(map(str, PROBED_THRESHOLDS))}. Rewards in nats per continuation token: the mean NLL, or the "
        "mean KL divergence from the full cache's next-token distribution (`loss`).",
        "",
        *markdown_table(summarise(rows)),
        "",
        "The neutral tables' own loss under each utility (the same prompts, the same cache held):",
        "",
        *markdown_table(utility_rows(rows)),
    ]
    write_results(rows, Path(args.out), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
