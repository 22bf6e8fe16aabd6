"""KVCompose on held-out retrieval prompts: kvcompile's compiled and dynamic modes against kvpress's KVComposePress,
snapkv and the full cache, with prefill time and peak memory, all in the same run. Needs the `bench` extra.

    .venv-bench/bin/python -m benchmarks.kvcompose.comparison [--grid 2048:0.1/0.5/0.9,4096:0.5]
        [--ratios 0.5,0.75,0.9] [--stats artifacts/.../kvcompose_stats.safetensors] [--out benchmarks/kvcompose/kvcompose_comparison.md]

Prompts: the pass key in filler, one needle and multi-key needles in Moby-Dick (none used for calibration, which
read Austen), at each (length: depths) of the grid. Question-agnostic (default): the context is compressed alone,
then the question is asked over the compressed cache; `--question-aware`: everything but the prompt's last token
is compressed, so the question is in the observation window. Greedy, exact match; every method answers through
the same decoding path. `--methods` keeps some of the methods (labels, comma-separated). Prefill: the prefill and compression of the context, timed per prompt and divided by the uncompressed
prefill of the same prompt in the same run. Peak memory: the peak resident memory of that step above the resident
memory before it (Linux VmHWM, reset before each prefill). Cache kept: KV bytes held after compression over the
full cache's.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from tqdm.auto import tqdm

import kvruntime
from benchmarks.reporting import run_header, write_results
from kvcompile.calibration.corpus import load_corpus
from kvcompile.evaluation.contestants import FullCache, Press, RuntimeMethod
from kvcompile.evaluation.runner import answer, split_prompt
from kvcompile.recipe import default_artifact
from kvcompile.tasks.retrieval import TASKS, retrieval_prompt

STATS = default_artifact("default", "kvcompose_stats")
FULL = "full cache"
METHODS = (  # label, what runs it
    ("kvcompose compiled", RuntimeMethod("kvcompose compiled", "kvcompose")),
    (
        "kvcompose compiled, unstructured (masked)",
        RuntimeMethod("unstructured", "kvcompose", {"unstructured": True}),
    ),
    ("kvcompose dynamic", RuntimeMethod("dynamic", "kvcompose", {"mode": "dynamic"})),
    ("kvpress KVComposePress", Press("kvpress-kvcompose", "kvcompose")),
    ("snapkv", RuntimeMethod("snapkv", "snapkv")),
)


def parse_grid(text: str) -> list[tuple[int, float]]:
    cells = []
    for part in text.split(","):
        length, depths = part.split(":")
        cells += [(int(length), float(d)) for d in depths.split("/")]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="2048:0.1/0.5/0.9,4096:0.5")
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--stats", type=Path, default=STATS)
    parser.add_argument("--question-aware", action="store_true")
    parser.add_argument("--methods", default=",".join(label for label, _ in METHODS))
    parser.add_argument("--out", default="benchmarks/kvcompose/kvcompose_comparison.md")
    args = parser.parse_args()
    ratios = [float(x) for x in args.ratios.split(",")]
    methods = [m for m in METHODS if m[0] in args.methods.split(",")]
    model, tokenizer = kvruntime.load_model()
    haystack = load_corpus("moby-dick")
    prompts = [
        retrieval_prompt(task, haystack, tokenizer, length, depth, seed=index)
        for index, (length, depth) in enumerate(parse_grid(args.grid))
        for task in TASKS
    ]
    rows = []
    out = Path(args.out)
    bar = tqdm(total=len(prompts) * (1 + len(methods) * len(ratios)), desc="kvcompose comparison", unit="run")
    for job, prompt in enumerate(prompts):
        context_ids, question_ids = split_prompt(tokenizer, prompt, args.question_aware)
        settings = [(FULL, FullCache(), 0.0)] + [(label, c, r) for r in ratios for label, c in methods]
        full = None
        for label, contestant, ratio in settings:
            stats = [args.stats] if contestant.artifact_kinds() else []
            result = answer(model, tokenizer, contestant, ratio, context_ids, question_ids, args.new_tokens, stats)
            full = full or result
            text, seconds = result.text, result.prefill_seconds
            rows.append(
                dict(
                    job=job,
                    task=prompt.task,
                    length=context_ids.shape[1],
                    depth=prompt.depth,
                    label=label,
                    ratio=ratio,
                    correct=int(prompt.score(text)),
                    prefill_seconds=round(seconds, 3),
                    prefill_vs_full=round(seconds / full.prefill_seconds, 3),
                    peak_mib=round(result.peak_mib, 1),
                    cache_kept=round(result.cache_bytes / full.cache_bytes, 4),
                    answer=text.strip().replace("\n", " ")[:80],
                )
            )
            bar.update()
        write_results(rows, out, render(rows, args, ratios, methods), quiet=True)
    bar.close()
    write_results(rows, out, render(rows, args, ratios, methods))


def render(rows: list[dict], args: argparse.Namespace, ratios: list[float], methods: tuple) -> str:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["label"], r["ratio"])].append(r)
    lengths = sorted({r["length"] for r in rows})
    lines = [
        "# KVCompose: compiled and dynamic modes against kvpress's KVComposePress (default model)",
        "",
        *run_header(in_venv=True),
        f"Stats: `{args.stats}`. "
        f"{len({r['job'] for r in rows})} held-out retrieval prompts (tasks {', '.join(TASKS)}; grid {args.grid}; "
        f"context lengths {', '.join(map(str, lengths))} tokens), "
        f"{'question-aware' if args.question_aware else 'question-agnostic'}, greedy, {args.new_tokens} new "
        "tokens, exact match. Prefill: prefill + compression of the context, median over prompts of its ratio to the "
        "uncompressed prefill of the same prompt. Peak memory: median over prompts of the peak resident memory "
        "during that step above the memory before it. Cache kept: KV bytes held over the full cache's (mean).",
        "",
        "| ratio | method | accuracy | "
        + " | ".join(TASKS)
        + " | prefill vs full | prefill (s, median) | peak memory (MiB) | cache kept |",
        "|---|---|---|" + "---|" * (len(TASKS) + 4),
    ]
    order = [(FULL, 0.0)] + [(label, r) for r in ratios for label, _ in methods]
    for label, ratio in order:
        cell = cells.get((label, ratio))
        if not cell:
            continue
        per_task = " | ".join(
            f"{sum(r['correct'] for r in cell if r['task'] == t)}/{sum(1 for r in cell if r['task'] == t)}"
            for t in TASKS
        )
        lines.append(
            f"| {ratio or '-'} | {label} | {sum(r['correct'] for r in cell)}/{len(cell)} | {per_task} | "
            f"{statistics.median(r['prefill_vs_full'] for r in cell):.2f}x | "
            f"{statistics.median(r['prefill_seconds'] for r in cell):.2f} | "
            f"{statistics.median(r['peak_mib'] for r in cell):.0f} | {statistics.mean(r['cache_kept'] for r in cell):.1%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
