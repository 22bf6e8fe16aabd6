"""Why compilerkv answers fewer retrieval questions than snapkv: the share of the answer's tokens (the pass key,
the needle's value) that each method keeps, on the ablation's held-out retrieval prompts.

    python benchmarks/compilerkv_coverage.py [--budgets 256,512] [--depths ...] [--out benchmarks/compilerkv_coverage.md]

Coverage = kept answer tokens / answer tokens, averaged over layers and KV heads.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from kvcompile.calibration.corpus import load_corpus
from kvcompile.tasks.retrieval import TASKS, TaskPrompt, retrieval_prompt

sys.path.insert(0, str(Path(__file__).parent))
from compilerkv_ablation import LEARNED, SNAPKV, TABLES, compressed  # noqa: E402
from reporting import machine, write_results  # noqa: E402


def answer_positions(tokenizer, text: str, answer: str) -> list[int]:
    """Token positions of the answer's first occurrence in the prompt."""
    start = text.lower().index(answer.lower())
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [i for i, (a, b) in enumerate(encoded.offset_mapping) if a < start + len(answer) and b > start]


def ratio_coverage_arguments(description: str, out: str) -> argparse.Namespace:
    """The command line of the coverage studies that sweep ratios (kvcompose's, distilled's); `ratios` parsed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--out", default=out)
    args = parser.parse_args()
    args.ratios = [float(x) for x in args.ratios.split(",")]
    return args


def question_agnostic_prompts(tokenizer, depths: str, length: int) -> list[tuple[TaskPrompt, torch.Tensor, list[int]]]:
    """The held-out retrieval prompts of the coverage studies (Moby-Dick haystack; each task at each depth): the
    prompt, its context's token ids without the question, and the answer's token positions in it."""
    haystack = load_corpus("moby-dick")
    found = []
    for index, depth in enumerate(depths.split(",")):
        for task in TASKS:
            prompt = retrieval_prompt(task, haystack, tokenizer, length, float(depth), seed=index)
            context = prompt.prompt[: prompt.question_start]
            ids = tokenizer(context, return_tensors="pt", add_special_tokens=False).input_ids
            found.append((prompt, ids, answer_positions(tokenizer, context, prompt.expected[0])))
    return found


def coverage(kept_positions: list[torch.Tensor], span: list[int]) -> float:
    wanted = torch.tensor(span)
    shares = [
        float(torch.isin(wanted, kept[0, head]).float().mean())
        for kept in kept_positions
        for head in range(kept.shape[1])
    ]
    return statistics.mean(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="256,512")
    parser.add_argument("--depths", default="0.05,0.275,0.5,0.725,0.95")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--tables", type=Path, default=TABLES)
    parser.add_argument("--out", default="benchmarks/compilerkv_coverage.md")
    args = parser.parse_args()
    budgets = [int(x) for x in args.budgets.split(",")]
    model, tokenizer = kvruntime.load_model()
    tables = kvruntime.CompilerKVTables.from_artifact(kvruntime.load_artifact(args.tables, model=model))
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
        f"Command: `python {' '.join(sys.argv)}`  ",
        f"Machine: {machine()}  ",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. Share of the answer's tokens kept, "
        "mean over layers, KV heads and prompts.",
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
