"""Retrieval accuracy of compresskv and its parts against snapkv, kvcompress and the full cache, on held-out
prompts (pass key in filler; needles and multi-key needles in Moby-Dick, none of them used for calibration).

    python -m benchmarks.compresskv.accuracy [--lengths 2048] [--depths 0.05,0.2,0.35,0.5,0.65,0.8,0.95] [--out benchmarks/compresskv/compresskv_accuracy.md]

Question-aware setting: the whole prompt (context + question) is prefilled, then compressed, then answered.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.reporting import run_header, write_results
from kvcompile.calibration.corpus import load_corpus
from kvcompile.recipe import artifact_folder
from kvcompile.tasks.retrieval import TASKS, retrieval_prompt

ARTIFACTS = artifact_folder("default")
METHODS = ("snapkv", "kvcompress", "srh", "compresskv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--depths", default="0.05,0.2,0.35,0.5,0.65,0.8,0.95")
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", default="benchmarks/compresskv/compresskv_accuracy.md")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    model, tokenizer = kvruntime.load_model()
    haystack = load_corpus("moby-dick")
    artifacts = [ARTIFACTS / "srh_heads.safetensors", ARTIFACTS / "layer_budgets.safetensors"]
    prompts = [
        retrieval_prompt(task, haystack, tokenizer, length, depth, seed=index)
        for task in TASKS
        for length in lengths
        for index, depth in enumerate(depths)
    ]
    settings = [("full", 0.0)] + [(m, r) for r in ratios for m in METHODS]
    rows = []
    bar = tqdm(total=len(prompts) * len(settings), desc="retrieval", unit="run")
    for prompt in prompts:
        ids = tokenizer(prompt.prompt, return_tensors="pt", add_special_tokens=False).input_ids
        for method, ratio in settings:
            greedy = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            if method == "full":
                with torch.no_grad():
                    output = model.generate(ids, **greedy)
                freed = 0.0
            else:
                with kvruntime.compress(model, method, ratio=ratio, artifacts=artifacts) as session:
                    output = model.generate(ids, **greedy)
                freed = session.report.bytes_freed_fraction
            text = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
            rows.append(
                dict(
                    task=prompt.task,
                    length=prompt.length,
                    depth=prompt.depth,
                    method=method,
                    ratio=ratio,
                    correct=int(prompt.score(text)),
                    bytes_freed=round(freed, 4),
                    answer=text,
                )
            )
            bar.update()
    bar.close()
    write_results(rows, Path(args.out), render(rows, args, settings))


def render(rows: list[dict], args: argparse.Namespace, settings: list[tuple[str, float]]) -> str:
    accuracy: dict[tuple, list[int]] = defaultdict(list)
    freed: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        accuracy[(row["method"], row["ratio"], row["task"])].append(row["correct"])
        accuracy[(row["method"], row["ratio"], "all")].append(row["correct"])
        freed[(row["method"], row["ratio"])].append(row["bytes_freed"])
    columns = [*TASKS, "all"]
    lines = [
        "# CompressKV on held-out retrieval prompts (default model)",
        "",
        *run_header(),
        f"Question-aware (prompt = context + "
        f"question, compressed after prefill), greedy, {args.new_tokens} new tokens, exact match of the expected value.",
        "",
        "| method | ratio | " + " | ".join(columns) + " | bytes freed |",
        "|---|---|" + "---|" * (len(columns) + 1),
    ]
    for method, ratio in settings:
        cells = []
        for column in columns:
            values = accuracy[(method, ratio, column)]
            cells.append(f"{sum(values)}/{len(values)}")
        mean_freed = sum(freed[(method, ratio)]) / len(freed[(method, ratio)])
        lines.append(f"| {method} | {ratio} | " + " | ".join(cells) + f" | {mean_freed:.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
