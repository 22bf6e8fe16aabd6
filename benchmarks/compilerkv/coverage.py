"""Why compilerkv answers fewer retrieval questions than snapkv: the share of the answer's tokens (the pass key,
the needle's value) that each method keeps, on the ablation's held-out retrieval prompts.

    python -m benchmarks.compilerkv.coverage [--budgets 256,512] [--depths ...] [--out benchmarks/compilerkv/compilerkv_coverage.md]

Coverage = kept answer tokens / answer tokens, averaged over layers and KV heads.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from tqdm.auto import tqdm

import kvruntime
from benchmarks.compilerkv.ablation import LEARNED, SNAPKV, TABLES, compressed
from benchmarks.coverage import answer_positions, coverage
from benchmarks.reporting import run_header, write_results
from kvcompile.calibration.corpus import load_corpus
from kvcompile.tasks.retrieval import TASKS, retrieval_prompt
from kvruntime.methods.compilerkv import CompilerKVTables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="256,512")
    parser.add_argument("--depths", default="0.05,0.275,0.5,0.725,0.95")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--tables", type=Path, default=TABLES)
    parser.add_argument("--out", default="benchmarks/compilerkv/compilerkv_coverage.md")
    args = parser.parse_args()
    budgets = [int(x) for x in args.budgets.split(",")]
    model, tokenizer = kvruntime.load_model()
    tables = CompilerKVTables.from_artifact(kvruntime.load_artifact(args.tables, model=model))
    haystack = load_corpus("moby-dick")
    prompts = [
        retrieval_prompt(task, haystack, tokenizer, args.length, depth, seed=index)
        for task in TASKS
        for index, depth in enumerate(float(x) for x in args.depths.split(","))
    ]
    rows = []
    for prompt in tqdm(prompts, desc="coverage", unit="prompt"):
        ids = tokenizer(prompt.prompt, return_tensors="pt", add_special_tokens=False).input_ids
        span = answer_positions(tokenizer, prompt.prompt, prompt.expected[0])
        for budget in budgets:
            with compressed(model, LEARNED, budget, tables) as session:
                session.prefill(ids)
            compilerkv = coverage(session.kept_positions, span)
            report = session.report
            matched = round(sum(report.entries_per_layer) / (report.num_kv_heads * len(report.entries_per_layer)))
            for label, size in (("compilerkv", None), ("snapkv", budget), ("snapkv at compilerkv's cache", matched)):
                if size is not None:
                    with compressed(model, SNAPKV, size, tables) as session:
                        session.prefill(ids)
                value = compilerkv if size is None else coverage(session.kept_positions, span)
                rows.append(
                    dict(task=prompt.task, depth=prompt.depth, budget=budget, method=label, coverage=round(value, 4))
                )
    write_results(rows, Path(args.out), render(rows, args, budgets))


def render(rows: list[dict], args: argparse.Namespace, budgets: list[int]) -> str:
    cells: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        cells[(r["budget"], r["method"], r["task"])].append(r["coverage"])
    methods = ("compilerkv", "snapkv", "snapkv at compilerkv's cache")
    lines = [
        "# Answer-token coverage on held-out retrieval prompts (default model)",
        "",
        *run_header(),
        "Share of the answer's tokens kept, mean over layers, KV heads and prompts.",
        "",
        "| budget | method | " + " | ".join(TASKS) + " |",
        "|---|---|" + "---|" * len(TASKS),
    ]
    for budget in budgets:
        for method in methods:
            shares = " | ".join(f"{statistics.mean(cells[(budget, method, t)]):.2f}" for t in TASKS)
            lines.append(f"| {budget} | {method} | {shares} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
