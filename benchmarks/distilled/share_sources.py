"""Layer shares compiled from one kind of calibration text: the shipped scorer with its compiled shares replaced by the
teacher's allocation averaged over all calibration prompts, over the novels' prompts only, or over the repeating
documents' only, as `kvcompile distill` computes them (`teacher_layer_shares`, the runtime's window, sinks and
floor). Each variant is written as an artifact folder for `kvcompile eval --methods distilled:artifacts=DIR`.

    python -m benchmarks.distilled.share_sources --variants share_variants   # 9 min on 2 cores

Beside them, per calibration prompt: its source document and the likeness of layer 0's attention input over its
first 512 tokens (`likeness_to_earlier`), the measure a prompt-following allocation would read.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import calibration_prompts, load_corpus
from kvcompile.recipe import default_artifact, load_model
from kvcompile.recipes.distilled.distill import SHARE_RATIOS, prompt_features_and_targets, teacher_layer_shares
from kvcompile.recipes.distilled.settings import DistillSettings
from kvruntime.artifacts.artifact import read_artifact, save_artifact
from kvruntime.methods.distilled.features import likeness_to_earlier
from kvruntime.methods.distilled.spec import SPEC

SCORER = default_artifact("default", "distilled_scorer")
NOVELS = 6  # austen-repeats: the six novels, then the repeating documents
SHOWN_RATIOS = (0.5, 0.75, 0.9)
LIKENESS_TOKENS = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=Path, required=True, help="folder of the variants' artifact folders")
    parser.add_argument("--out", default="benchmarks/distilled/share_sources.md")
    args = parser.parse_args()
    settings = DistillSettings()
    model, tokenizer = load_model("default")
    prompts = calibration_prompts(
        load_corpus("austen-repeats"), tokenizer, settings.prompts, settings.prompt_tokens, settings.seed
    )
    rows, shares = [], []
    sinks, floor = int(SPEC.options["sinks"].default), float(SPEC.options["floor"].default)
    for index, (source, ids) in enumerate(prompts):
        inputs, targets = prompt_features_and_targets(model, tokenizer, ids, settings.oracle)
        hidden = inputs[0][None, :LIKENESS_TOKENS, : model.config.hidden_size]
        likeness = likeness_to_earlier(hidden.float())[0, 2:].mean().item()
        shares.append(teacher_layer_shares(targets, SPEC.window, sinks, floor))
        kind = "novel" if source < NOVELS else "repeating"
        rows.append(dict(prompt=index, source=source, kind=kind, layer0_likeness=round(likeness, 4)))
        print(rows[-1], flush=True)
    base = read_artifact(SCORER)
    groups = {"all": range(len(prompts)), "novels": [], "repeating": []}
    for row in rows:
        groups["novels" if row["kind"] == "novel" else "repeating"].append(row["prompt"])
    table = []
    for name, members in groups.items():
        mean = torch.stack([shares[i] for i in members]).mean(0).float()
        artifact = dataclasses.replace(base, tensors={**base.tensors, "layer_shares": mean})
        folder = args.variants / name
        folder.mkdir(parents=True, exist_ok=True)
        save_artifact(artifact, folder / "distilled_scorer.safetensors")
        for ratio in SHOWN_RATIOS:
            layers = mean[SHARE_RATIOS.index(ratio)] * mean.shape[1]
            table.append(
                dict(
                    shares=name,
                    prompts=len(members),
                    ratio=ratio,
                    **{f"L{i}": f"{v:.2f}" for i, v in enumerate(layers)},
                )
            )
    lines = [
        "# Layer shares by calibration text",
        "",
        *run_header(),
        "",
        "Each layer's share of the kept cache times the number of layers (1 = the average) in the teacher's allocation,",
        "averaged over all calibration prompts (the shipped shares, recompiled at the runtime's window), the novels'",
        "only, or the repeating documents' only. Judged in [`eval_share_sources/`](eval_share_sources/README.md).",
        "",
        *markdown_table(table),
        "",
        "Per calibration prompt: the likeness of layer 0's input over its first 512 tokens.",
        "",
        *markdown_table(rows),
        "",
    ]
    write_results(rows, Path(args.out), "\n".join(lines))


if __name__ == "__main__":
    main()
