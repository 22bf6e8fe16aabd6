"""The CompilerKV ablation on held-out prompts (none used for calibration): full compilerkv, compilerkv with
W_head = 1, compilerkv with one fixed threshold, snapkv at the same budget, and snapkv at the cache compilerkv
really kept (its gate may keep fewer entries than the budget), plus the full cache.

    python benchmarks/compilerkv_ablation.py [--budgets 128,256,512,1024] [--depths 0.05,0.275,0.5,0.725,0.95]
        [--passages 8] [--tables artifacts/.../compilerkv_tables.safetensors] [--out benchmarks/compilerkv_ablation.md]

Two measures per setting: retrieval accuracy (pass key in filler, a needle and multi-key needles in Moby-Dick,
~2k tokens, question-aware: prompt = context + question, compressed after prefill, greedy, exact match), and the
increase in mean NLL of a 128-token continuation of ~2k-token Moby-Dick passages (the reward the tables learned
from, on text they never saw).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import kvruntime
from kvcompile.calibration.corpus import calibration_prompts, load_corpus
from kvcompile.tasks.retrieval import TASKS, retrieval_prompt

sys.path.insert(0, str(Path(__file__).parent))
from reporting import machine, write_results  # noqa: E402

TABLES = Path("artifacts/smollm2-135m-instruct/compilerkv_tables.safetensors")
FIXED_THRESHOLD = 0.9  # the middle of the threshold grid [0.8, 1.0]
VARIANTS = (
    ("compilerkv", {}),
    ("compilerkv, W_head = 1", {"uniform_heads": True}),
    (f"compilerkv, threshold {FIXED_THRESHOLD}", {"fixed_threshold": FIXED_THRESHOLD}),
)
SNAPKV, MATCHED = "snapkv", "snapkv at compilerkv's cache"


def compressed(model, method: str, budget: int | None, options: dict, tables: Path):
    artifacts = [tables] if method == "compilerkv" else []
    if budget is None:  # the full cache: nothing removed
        return kvruntime.compress(model, "snapkv", ratio=0.0)
    return kvruntime.compress(model, method, budget=budget, artifacts=artifacts, options=options)


def retrieval_run(model, tokenizer, ids, prompt, method, budget, options, tables, new_tokens):
    with compressed(model, method, budget, options, tables) as session:
        output = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
    return float(prompt.score(text)), session.report, text


def continuation_run(model, context, continuation, method, budget, options, tables):
    """Mean NLL of continuation tokens 1.. given the compressed context (token 0 comes from the prefill alone)."""
    with compressed(model, method, budget, options, tables) as session:
        cache = session.prefill(context).cache
        start = context.shape[1]
        positions = torch.arange(start, start + continuation.shape[1] - 1)[None]
        with torch.no_grad():
            logits = model(
                input_ids=continuation[:, :-1], **kvruntime.cache_argument(model, cache), position_ids=positions
            ).logits
    return float(F.cross_entropy(logits[0].float(), continuation[0, 1:])), session.report, ""


def settings_for(budgets: list[int]):
    """(label, method, budget, options) rows; MATCHED rows get their budget from the compilerkv run before them."""
    rows = [("full cache", "full", None, {})]
    for budget in budgets:
        rows += [(label, "compilerkv", budget, options) for label, options in VARIANTS]
        rows += [(SNAPKV, "snapkv", budget, {}), (MATCHED, "snapkv", budget, {})]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="128,256,512,1024")
    parser.add_argument("--depths", default="0.05,0.275,0.5,0.725,0.95")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--passages", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--tables", type=Path, default=TABLES)
    parser.add_argument("--out", default="benchmarks/compilerkv_ablation.md")
    args = parser.parse_args()
    budgets = [int(x) for x in args.budgets.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    model, tokenizer = kvruntime.load_model()
    haystack = load_corpus("moby-dick")
    jobs = [
        ("retrieval", p.task, p, tokenizer(p.prompt, return_tensors="pt", add_special_tokens=False).input_ids)
        for p in (
            retrieval_prompt(task, haystack, tokenizer, args.length, depth, seed=index)
            for task in TASKS
            for index, depth in enumerate(depths)
        )
    ]
    # Held-out continuation passages: Moby-Dick, seeds apart from every calibration run (which reads Austen).
    jobs += [
        ("nll", "moby-dick", None, ids)
        for _, ids in calibration_prompts(haystack, tokenizer, args.passages, args.length + 128, seed=7919)
    ]
    rows = []
    settings = settings_for(budgets)
    bar = tqdm(total=len(jobs) * len(settings), desc="ablation", unit="run")
    for job, (kind, task, prompt, ids) in enumerate(jobs):
        kept_by_compilerkv = None
        for label, method, nominal, options in settings:
            budget = kept_by_compilerkv if label == MATCHED else nominal
            if kind == "retrieval":
                value, report, text = retrieval_run(
                    model, tokenizer, ids, prompt, method, budget, options, args.tables, args.new_tokens
                )
            else:
                context, continuation = ids[:, : args.length], ids[:, args.length :]
                value, report, text = continuation_run(
                    model, context, continuation, method, budget, options, args.tables
                )
            kept = 1.0 - report.entries_removed_fraction
            if label == "compilerkv":
                kept_by_compilerkv = round(kept * report.context_length)
            rows.append(
                dict(
                    job=job,
                    kind=kind,
                    task=task,
                    label=label,
                    nominal=nominal or 0,
                    budget=budget or 0,
                    value=value,
                    cache_kept=round(kept, 4),
                    answer=text,
                )
            )
            bar.update()
    bar.close()
    write_results(rows, Path(args.out), render(rows, args, budgets, len(jobs) - args.passages))


def render(rows: list[dict], args: argparse.Namespace, budgets: list[int], retrieval_prompts: int) -> str:
    full_nll = {r["job"]: r["value"] for r in rows if r["kind"] == "nll" and r["label"] == "full cache"}
    cells: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cell = cells[(r["label"], r["nominal"])]
        cell["kept"].append(r["cache_kept"])
        if r["kind"] == "retrieval":
            cell[r["task"]].append(r["value"])
            cell["all"].append(r["value"])
        else:
            cell["nll"].append(r["value"] - full_nll[r["job"]])
    order = [("full cache", 0)] + [
        (label, budget) for budget in budgets for label in [*(v for v, _ in VARIANTS), SNAPKV, MATCHED]
    ]
    columns = [*TASKS, "all"]
    lines = [
        "# CompilerKV ablation on held-out prompts (default model)",
        "",
        f"Command: `python {' '.join(sys.argv)}`  ",
        f"Machine: {machine()}  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Tables: `{args.tables}`. Retrieval: "
        f"{retrieval_prompts} prompts of ~{args.length} tokens (question-aware, greedy, {args.new_tokens} new tokens, exact "
        f"match). NLL: increase in mean token NLL of a 128-token continuation over the full cache, mean over "
        f"{args.passages} Moby-Dick passages of {args.length} tokens (lower is better). Cache kept: share of the "
        "full cache's entries attended after compression (mean over all prompts).",
        "",
        "| budget | method | " + " | ".join(columns) + " | NLL increase | cache kept |",
        "|---|---|" + "---|" * (len(columns) + 2),
    ]
    for label, nominal in order:
        cell = cells[(label, nominal)]
        scores = " | ".join(f"{int(sum(cell[c]))}/{len(cell[c])}" for c in columns)
        nll = statistics.mean(cell["nll"]) if cell["nll"] else float("nan")
        lines.append(f"| {nominal or 'full'} | {label} | {scores} | {nll:+.4f} | {statistics.mean(cell['kept']):.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
