"""The CompilerKV ablation on held-out prompts (none used for calibration), at equal cache held: the learned tables
against W_head = 1, against one fixed threshold, and against random tables of the same value range, with paired
bootstrap 95% intervals; snapkv at the same budget and the paper's elastic gate for reference.

    python -m benchmarks.compilerkv.ablation [--budgets 256,512] [--depths 0.05,0.275,0.5,0.725,0.95]
        [--passages 32] [--random-draws 4] [--tables artifacts/.../compilerkv_tables.safetensors]
        [--continuations corpus,greedy] [--variants "learned tables,W_head = 1,..."]

Every compilerkv variant but the elastic one holds exactly budget x layers entries (the ratio-honest rule), so the
comparisons are at equal cache by construction; the table says what each really held. Measures per prompt: the
increase in mean NLL of a 128-token continuation of ~2k-token Moby-Dick passages over the full cache and the mean
KL divergence from the full cache's next-token distributions along it (the tables' own objectives, on text they
never saw), on the corpus's continuation and on the full-cache model's greedy one (`--continuations`), and
retrieval (pass key in filler, a needle and multi-key needles
in Moby-Dick, ~2k tokens, question-aware: the prompt holds the question, compressed after prefill, greedy, exact
match). Random tables: each prompt gets one of `--random-draws` tables drawn uniformly from the action grids, with
the learned tables' bin edges. Intervals: the per-prompt difference (variant minus learned) averaged, 10,000
bootstrap resamples over prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import calibration_prompts, load_corpus
from kvcompile.evaluation.metrics import bootstrap_interval
from kvcompile.recipe import default_artifact
from kvcompile.recipes.compilerkv.bandit_experience import GATE_ACTIONS, HEAD_ACTIONS
from kvcompile.recipes.compilerkv.continuation_nll import kl_from_reference
from kvcompile.recipes.compilerkv.experience_collection import greedy_continuation
from kvcompile.tasks.retrieval import TASKS, retrieval_prompt
from kvruntime.methods import CompilerKV
from kvruntime.methods.compilerkv import CompilerKVTables
from kvruntime.plumbing.cache_ops import cache_argument

TABLES = default_artifact("default", "compilerkv_tables")
FIXED_THRESHOLD = 0.9  # the middle of the threshold grid [0.8, 1.0]
LEARNED, RANDOM = "learned tables", "random tables"
VARIANTS = {  # label -> compilerkv options (RANDOM: other tables, the options of LEARNED)
    LEARNED: {},
    "W_head = 1": {"uniform_heads": True},
    f"threshold {FIXED_THRESHOLD} everywhere": {"fixed_threshold": FIXED_THRESHOLD},
    RANDOM: {},
    "neutral tables": {"uniform_heads": True, "fixed_threshold": FIXED_THRESHOLD},
    "learned tables, elastic gate": {"elastic": True},
}
SNAPKV = "snapkv"
COMPARED = ("W_head = 1", f"threshold {FIXED_THRESHOLD} everywhere", RANDOM, "neutral tables")
CONTINUATION_MEASURES = (("nll", "NLL increase"), ("kl", "KL from the full cache"))  # lower is better


def random_tables(learned: CompilerKVTables, seed: int) -> CompilerKVTables:
    """Tables of the learned ones' shapes and bin edges, each entry drawn uniformly from its action grid."""
    g = torch.Generator().manual_seed(seed)
    return dataclasses.replace(
        learned,
        head_reliability=HEAD_ACTIONS[torch.randint(len(HEAD_ACTIONS), learned.head_reliability.shape, generator=g)],
        risk_thresholds=GATE_ACTIONS[torch.randint(len(GATE_ACTIONS), learned.risk_thresholds.shape, generator=g)],
    )


def compressed(model, label: str, budget: int | None, tables: CompilerKVTables):
    if budget is None:  # the full cache: nothing removed
        return kvruntime.compress(model, "snapkv", ratio=0.0)
    if label == SNAPKV:
        return kvruntime.compress(model, "snapkv", budget=budget)
    method = CompilerKV(tables=tables, nearest_budget=True, **VARIANTS[label])
    return kvruntime.compress(model, method, budget=budget)


def retrieval_run(model, tokenizer, ids, prompt, session_factory, new_tokens) -> tuple[float, object]:
    with session_factory() as session:
        output = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
    return float(prompt.score(text)), session.report


def continuation_run(model, context, continuation, session_factory) -> tuple[torch.Tensor, object]:
    """The log-probabilities [c - 1, V] of continuation tokens 1.. given the compressed context (token 0 comes from
    the prefill alone)."""
    with session_factory() as session:
        cache = session.prefill(context).cache
        start = context.shape[1]
        positions = torch.arange(start, start + continuation.shape[1] - 1)[None]
        with torch.no_grad():
            logits = model(
                input_ids=continuation[:, :-1], **cache_argument(model, cache), position_ids=positions
            ).logits
    return F.log_softmax(logits[0].float(), dim=-1), session.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="256,512")
    parser.add_argument("--depths", default="0.05,0.275,0.5,0.725,0.95")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--passages", type=int, default=32)
    parser.add_argument("--random-draws", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--tables", type=Path, default=TABLES)
    parser.add_argument("--continuations", default="corpus", help="corpus, greedy (comma-separated)")
    parser.add_argument("--variants", default=",".join([*VARIANTS, SNAPKV]), help="comma-separated labels")
    parser.add_argument("--out", default="benchmarks/compilerkv/compilerkv_ablation.md")
    args = parser.parse_args()
    budgets = [int(x) for x in args.budgets.split(",")]
    depths = [float(x) for x in args.depths.split(",") if x]
    labels = args.variants.split(",")
    if unknown := set(labels) - {*VARIANTS, SNAPKV}:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {[*VARIANTS, SNAPKV]}")
    model, tokenizer = kvruntime.load_model()
    learned = CompilerKVTables.from_artifact(kvruntime.load_artifact(args.tables, model=model))
    draws = [random_tables(learned, seed) for seed in range(args.random_draws)]
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
    passages = calibration_prompts(haystack, tokenizer, args.passages, args.length + 128, seed=7919)
    for source in args.continuations.split(","):
        jobs += [
            (
                "continuation",
                source,
                None,
                ids if source == "corpus" else greedy_continuation(model, ids, args.length, 128),
            )
            for _, ids in passages
        ]
    settings = [("full cache", None)] + [(label, b) for b in budgets for label in labels]
    rows, full_logprobs = [], {}
    bar = tqdm(total=len(jobs) * len(settings), desc="ablation", unit="run")
    for job, (kind, task, prompt, ids) in enumerate(jobs):
        for label, budget in settings:
            tables = draws[job % len(draws)] if label == RANDOM else learned

            def session_factory(label=label, budget=budget, tables=tables):
                return compressed(model, label, budget, tables)

            measures = {}
            if kind == "retrieval":
                measures["value"], report = retrieval_run(
                    model, tokenizer, ids, prompt, session_factory, args.new_tokens
                )
            else:
                context, continuation = ids[:, : args.length], ids[:, args.length :]
                logprobs, report = continuation_run(model, context, continuation, session_factory)
                full_logprobs.setdefault(job, logprobs)  # the full cache runs first
                measures["nll"] = float(F.nll_loss(logprobs, continuation[0, 1:]))
                measures["kl"] = float(kl_from_reference(full_logprobs[job], logprobs)) / len(logprobs)
            rows.append(
                dict(
                    job=job,
                    kind=kind,
                    task=task,
                    label=label,
                    budget=budget or 0,
                    **measures,
                    cache_kept=round(1.0 - report.entries_removed_fraction, 4),
                )
            )
            bar.update()
    bar.close()
    write_results(rows, Path(args.out), render(rows, args, budgets, labels))


def paired_rows(rows: list[dict], budgets: list[int], labels: list[str]) -> list[dict]:
    """Each compared variant minus the learned tables, per prompt, with a bootstrap interval."""
    measures = [
        (kind, task, field, f"{name}, {task} continuation (lower is better)")
        for kind, task in sorted({(r["kind"], r["task"]) for r in rows if r["kind"] == "continuation"})
        for field, name in CONTINUATION_MEASURES
    ]
    if any(r["kind"] == "retrieval" for r in rows):
        measures.append(("retrieval", None, "value", "retrieval accuracy"))
    out = []
    for budget in budgets:
        for kind, task, field, measure in measures:
            cell = [r for r in rows if r["kind"] == kind and task in (None, r["task"])]
            value = {(r["job"], r["label"]): r[field] for r in cell if r["budget"] == budget}
            jobs = sorted({r["job"] for r in cell})
            for label in (x for x in (*COMPARED, SNAPKV) if x in labels):
                differences = [value[(j, label)] - value[(j, LEARNED)] for j in jobs]
                low, high = bootstrap_interval(differences)
                sign = 1 if kind == "continuation" else -1  # the learned tables are ahead where sign * difference > 0
                out.append(
                    {
                        "budget": budget,
                        "measure": measure,
                        "variant": label,
                        "variant minus learned": f"{statistics.mean(differences):+.4f}",
                        "95% interval": f"{low:+.4f} to {high:+.4f}",
                        "prompts": len(jobs),
                        "learned ahead": sum(sign * d > 0 for d in differences),
                        "variant ahead": sum(sign * d < 0 for d in differences),
                    }
                )
    return out


def render(rows: list[dict], args: argparse.Namespace, budgets: list[int], labels: list[str]) -> str:
    full_nll = {r["job"]: r["nll"] for r in rows if r["kind"] == "continuation" and r["label"] == "full cache"}
    sources = sorted({r["task"] for r in rows if r["kind"] == "continuation"})
    summary = []
    for label, budget in [("full cache", 0)] + [(label, b) for b in budgets for label in labels]:
        cell = [r for r in rows if (r["label"], r["budget"]) == (label, budget)]
        retrieval = [r["value"] for r in cell if r["kind"] == "retrieval"]
        per_task = {t: [r["value"] for r in cell if r["task"] == t] for t in TASKS}
        continuation = {}
        for source in sources:
            runs = [r for r in cell if r["kind"] == "continuation" and r["task"] == source]
            continuation[f"NLL increase, {source}"] = (
                f"{statistics.mean(r['nll'] - full_nll[r['job']] for r in runs):+.4f}"
            )
            continuation[f"KL, {source}"] = f"{statistics.mean(r['kl'] for r in runs):.4f}"
        summary.append(
            {
                "budget": budget or "full",
                "method": label,
                **({t: f"{int(sum(v))}/{len(v)}" for t, v in per_task.items()} if retrieval else {}),
                **({"retrieval": f"{int(sum(retrieval))}/{len(retrieval)}"} if retrieval else {}),
                **continuation,
                "cache held": f"{np.mean([r['cache_kept'] for r in cell]):.1%}",
            }
        )
    retrieval_prompts = len({r["job"] for r in rows if r["kind"] == "retrieval"})
    lines = [
        "# CompilerKV ablation on held-out prompts, at equal cache held (default model)",
        "",
        *run_header(),
        f"Tables: `{args.tables}`. Retrieval: "
        f"{retrieval_prompts} prompts of ~{args.length} tokens (question-aware, greedy, {args.new_tokens} new tokens, "
        f"exact match). NLL: increase in mean token NLL of a 128-token continuation over the full cache; KL: mean KL "
        f"divergence from the full cache's next-token distributions along it; {args.passages} Moby-Dick passages of "
        f"{args.length} tokens, continued by the corpus or by the full-cache model's greedy decoding. Random tables: {args.random_draws} draws, one "
        "per prompt in turn. Cache held: share of the full cache's entries attended after compression (mean).",
        "",
        *markdown_table(summary),
        "",
        "## Paired differences against the learned tables (95% bootstrap intervals over prompts)",
        "",
        *markdown_table(paired_rows(rows, budgets, labels)),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
