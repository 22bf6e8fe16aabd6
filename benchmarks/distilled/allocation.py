"""How distilled's layer allocation should share the cache: the global pool alone, a floor per layer, or uniform.

    python -m benchmarks.distilled.allocation [--samples 3] [--lengths 1k,2k] [--floors 0,0.1,0.25,0.5] [--seed 11]

Question-agnostic retrieval prompts of the eval suite drawn with another seed than `kvcompile eval`'s (0), so that
the floor chosen here is not chosen on the prompts the comparison is reported on. Only prompts the full cache
answers count. Per floor and ratio: prompts answered, and paired wins/losses against floor 0 (the pool alone);
`uniform` is `allocation=uniform`. The figure shows the tokens each layer keeps at the largest ratio, averaged
over the prompts: the pool's cliff and what the floor does to it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import load_corpus
from kvcompile.evaluation.runner import split_prompt
from kvcompile.plotting import plt, save_figure
from kvcompile.recipe import default_artifact
from kvcompile.tasks.grid import parse_lengths
from kvcompile.tasks.suite import suite_prompts

TASKS = ("passkey", "needle", "multikey", "multivalue", "variable_tracking")
SCORER = str(default_artifact("default", "distilled_scorer"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--lengths", default="1k,2k")
    parser.add_argument("--floors", default="0,0.1,0.25,0.5")
    parser.add_argument("--ratios", default="0.75,0.9")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", default="benchmarks/distilled/distilled_allocation.md")
    args = parser.parse_args()
    floors = [float(f) for f in args.floors.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    # The dynamic pool's floors and the uniform split, as the study measured them (before `leverage` and the compiled
    # default: spelled out).
    variants = [(f"floor {f:g}", {"allocation": "dynamic", "floor": f, "leverage": 0.0}) for f in floors]
    variants.append(("uniform", {"allocation": "uniform", "leverage": 0.0}))
    model, tokenizer = kvruntime.load_model("default")
    prompts = suite_prompts(
        load_corpus("moby-dick"), tokenizer, TASKS, parse_lengths(args.lengths), args.samples, args.seed
    )

    def answer(ratio: float, options: dict, context_ids: torch.Tensor, question_ids: torch.Tensor):
        with kvruntime.compress(model, "distilled", ratio=ratio, artifacts=[SCORER], options=options) as session:
            context = session.prefill(context_ids)
            output = context.generate(
                question_ids, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
        return tokenizer.decode(output[0, question_ids.shape[1] :], skip_special_tokens=True), session.report

    correct: dict[tuple[str, float], list[int]] = {}
    kept: dict[str, list[list[float]]] = {}
    answerable = []
    for prompt in tqdm(prompts, desc="prompts", unit="prompt"):
        context_ids, question_ids = split_prompt(tokenizer, prompt, question_aware=False)
        full_text, _ = answer(0.0, {}, context_ids, question_ids)  # ratio 0: the whole cache
        if not prompt.score(full_text):
            continue
        answerable.append(prompt)
        for ratio in ratios:
            for name, options in variants:
                text, report = answer(ratio, options, context_ids, question_ids)
                correct.setdefault((name, ratio), []).append(int(prompt.score(text)))
                if ratio == max(ratios):
                    kept.setdefault(name, []).append([s / report.context_length for s in report.slots_per_layer])
    rows = []
    for (name, ratio), hits in correct.items():
        base = correct[(variants[0][0], ratio)]
        rows.append(
            {
                "allocation": name,
                "ratio": ratio,
                "prompts": len(hits),
                "answered": sum(hits),
                "wins_vs_pool": sum(h > b for h, b in zip(hits, base)),
                "losses_vs_pool": sum(h < b for h, b in zip(hits, base)),
            }
        )
    tasks = sorted({p.task for p in answerable})
    markdown = "\n".join(
        [
            "# Distilled: how the layers share the cache",
            "",
            *run_header(),
            f"Question-agnostic prompts of "
            f"the eval suite drawn with seed {args.seed} (the eval's is 0): {len(prompts)} prompts, of which the full "
            f"cache answers {len(answerable)} ({', '.join(tasks)}); only those count. `floor f`: every layer keeps "
            "at least f times the average tokens per layer, the rest by the global pool of predicted scores; "
            "wins/losses: prompts answered / missed where floor 0 (the pool alone) did the opposite.",
            "",
            *markdown_table(rows),
            "",
            f"![tokens kept per layer]({Path(args.out).with_suffix('.png').name})",
            "",
        ]
    )
    write_results(rows, Path(args.out), markdown)
    figure, axes = plt.subplots(figsize=(8, 4))
    for name, shares in kept.items():
        axes.plot(torch.tensor(shares).mean(dim=0).tolist(), marker=".", label=name)
    axes.set(
        xlabel="layer",
        ylabel="share of the prompt kept",
        yscale="log",
        title=f"distilled at ratio {max(ratios)}: tokens kept per layer (mean over {len(answerable)} prompts)",
    )
    axes.legend()
    save_figure(figure, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
