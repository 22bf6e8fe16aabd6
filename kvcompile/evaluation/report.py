"""Tables and plots of an evaluation run: one row per method x ratio x task x length (CSV and Markdown), a summary
per method x ratio with the area under the accuracy-versus-ratio curve, accuracy versus ratio per task, and a
needle-in-a-haystack heatmap (depth x length) per method and ratio."""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from kvcompile.evaluation.contestants import FULL
from kvcompile.evaluation.metrics import accuracy_auc, bootstrap_interval, grouped
from kvcompile.evaluation.store import write_text_atomically
from kvcompile.tasks.grid import TEXT_TYPES

GROUP_COLUMNS = ("method", "ratio", "task", "length")
KL_FLOOR = 1e-4  # nats: below it two distributions are the same for any answer; keeps log KL finite
# The continuous fidelity measures, paired per prompt at each ratio (issue #49: they decide where answer counts cannot):
# the log of the KL from the full cache averaged over its answer's tokens (lower is more faithful), and the expected
# answer's log-probability (higher is better). Records written before they existed lack them.
FIDELITY_MEASURES = {
    "log_answer_kl": lambda r: math.log(r["answer_kl"] + KL_FLOOR),
    "answer_logprob": lambda r: r["answer_logprob"],
}


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def with_peak_ratios(records: list[dict]) -> list[dict]:
    """Each record with `peak_vs_full`: its peak memory over the full cache's on the same prompt (None where
    memory was not measured)."""
    full = {r["prompt"]: r["peak_mib"] for r in records if r["method"] == FULL}
    return [
        {
            **r,
            "peak_vs_full": r["peak_mib"] / full[r["prompt"]]
            if r["peak_mib"] is not None and full.get(r["prompt"])
            else None,
        }
        for r in records
    ]


def _has_fidelity(records: list[dict]) -> bool:
    return all("answer_kl" in r for r in records)


def _summary(records: list[dict]) -> dict:
    fidelity = (
        dict(
            answer_kl=round(statistics.mean(r["answer_kl"] for r in records), 4),
            answer_logprob=round(statistics.mean(r["answer_logprob"] for r in records), 3),
        )
        if _has_fidelity(records)
        else {}
    )
    return dict(
        prompts=len(records),
        accuracy=round(statistics.mean(r["correct"] for r in records), 4),
        kl=round(statistics.mean(r["kl"] for r in records), 4),
        **fidelity,
        agreement=round(statistics.mean(r["agreement"] for r in records), 4),
        prefill_vs_full=round(_median(r["prefill_vs_full"] for r in records), 3),
        peak_mib=_median(r["peak_mib"] for r in records),
        peak_vs_full=_round(_median(r.get("peak_vs_full") for r in records), 3),
        cache_kept=round(statistics.mean(r["cache_kept"] for r in records), 4),
    )


def results_table(records: list[dict]) -> list[dict]:
    """One row per method x ratio x task x length, in the order the records came."""
    groups = grouped(records, lambda r: tuple(r[c] for c in GROUP_COLUMNS))
    return [dict(zip(GROUP_COLUMNS, key), **_summary(rows)) for key, rows in groups.items()]


def method_curves(records: list[dict]) -> dict[str, dict[float, float]]:
    """Accuracy over the whole suite per method and ratio (the full cache at ratio 0)."""
    curves: dict[str, dict[float, float]] = defaultdict(dict)
    for (method, ratio), rows in grouped(records, lambda r: (r["method"], r["ratio"])).items():
        curves[method][ratio] = statistics.mean(r["correct"] for r in rows)
    return dict(curves)


def summary_table(records: list[dict]) -> list[dict]:
    """One row per method x ratio over the whole suite, with each method's area under its accuracy curve."""
    curves = method_curves(records)
    full = curves[FULL][0.0]
    rows = []
    for (method, ratio), group in grouped(records, lambda r: (r["method"], r["ratio"])).items():
        auc = full if method == FULL else accuracy_auc(full, curves[method])
        rows.append(dict(method=method, ratio=ratio, **_summary(group), auc=round(auc, 4)))
    return sorted(rows, key=lambda r: (r["ratio"], -r["accuracy"], r["method"]))


def prompt_aucs(records: list[dict]) -> dict[str, dict[int, float]]:
    """Each method's AUC on each prompt (through the full cache's answer to it); over the same prompts their mean is
    the suite's AUC, since the trapezoid is linear in the accuracies."""
    full = {r["prompt"]: r["correct"] for r in records if r["method"] == FULL}
    curves: dict[tuple[str, int], dict[float, float]] = defaultdict(dict)
    for r in records:
        if r["method"] != FULL and r["prompt"] in full:
            curves[(r["method"], r["prompt"])][r["ratio"]] = r["correct"]
    aucs: dict[str, dict[int, float]] = defaultdict(dict)
    for (method, prompt), curve in curves.items():
        aucs[method][prompt] = accuracy_auc(full[prompt], curve)
    return dict(aucs)


def paired_auc_table(records: list[dict], subject: str) -> list[dict]:
    """`subject`'s AUC minus each other method's, paired over the prompts both answered, with a 95% bootstrap
    interval over prompts and the prompts on which either is the higher: what a claim that one beats another needs."""
    aucs = prompt_aucs(records)
    return [{"method": other, **_paired(aucs[subject], aucs[other], subject)} for other in aucs if other != subject]


def paired_accuracy_table(records: list[dict], subject: str) -> list[dict]:
    """The same at each ratio: `subject`'s accuracy minus each other method's at equal ratio, paired over prompts
    (a claim at one ratio, where the AUC sums over them)."""
    return paired_by_ratio(records, subject, lambda r: r["correct"])


def paired_by_ratio(records: list[dict], subject: str, value: Callable[[dict], float]) -> list[dict]:
    """`subject`'s `value` minus each other method's at equal ratio, paired over the prompts both answered."""
    values: dict[tuple[str, float], dict[int, float]] = defaultdict(dict)
    for r in records:
        if r["method"] != FULL:
            values[(r["method"], r["ratio"])][r["prompt"]] = value(r)
    return [
        {"method": method, "ratio": ratio, **_paired(values[(subject, ratio)], by_prompt, subject)}
        for (method, ratio), by_prompt in sorted(values.items(), key=lambda item: item[0][1])
        if method != subject and (subject, ratio) in values
    ]


def _paired(subject_values: dict[int, float], other_values: dict[int, float], subject: str) -> dict:
    """The mean of the per-prompt differences over the prompts both have, its 95% bootstrap interval, and counts."""
    prompts = sorted(set(subject_values) & set(other_values))
    differences = [subject_values[p] - other_values[p] for p in prompts]
    low, high = bootstrap_interval(differences)
    return {
        f"{subject}_minus_method": round(statistics.mean(differences), 4),
        "low_95": round(low, 4),
        "high_95": round(high, 4),
        "prompts": len(prompts),
        # "higher", not "ahead": for log KL the higher is the less faithful
        f"{subject}_higher": sum(d > 0 for d in differences),
        "method_higher": sum(d < 0 for d in differences),
    }


def to_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def to_markdown(rows: list[dict]) -> str:
    def cell(value: object) -> str:
        if value is None:
            return "-"
        return f"{value:.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)

    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _paired_section(records: list[dict], subject: str | None) -> list[str]:
    paired = paired_auc_table(records, subject) if subject else []
    if not paired:
        return []
    return [
        f"## {subject}'s AUC against each method's, paired over prompts",
        "",
        "The difference of the AUCs per prompt, averaged (the difference of the suite's AUCs), with a 95% bootstrap "
        "interval over prompts (10,000 resamples); higher: prompts on which one method's value is the larger (for the "
        "AUC, accuracy and answer_logprob the better; for log_answer_kl the less faithful).",
        "",
        to_markdown(paired),
        f"## {subject}'s accuracy against each method's at each ratio, paired over prompts",
        "",
        "The difference of the answers per prompt at equal ratio, averaged, with the same interval.",
        "",
        to_markdown(paired_accuracy_table(records, subject)),
        *(_fidelity_section(records, subject) + _text_type_section(records, subject) if _has_fidelity(records) else []),
    ]


def _fidelity_section(records: list[dict], subject: str) -> list[str]:
    lines = [
        f"## {subject}'s fidelity against each method's at each ratio, paired over prompts",
        "",
        f"log_answer_kl: log(KL + {KL_FLOOR:g}) of the answer distributions from the full cache's, averaged over the "
        "tokens of the full cache's answer (both teacher-forced on it); a negative difference: the subject is the "
        "more faithful. answer_logprob: log-probability (nats) of the expected answer after the question; a "
        "positive difference: the subject gives it more. These decide where answer counts cannot.",
        "",
    ]
    for name, value in FIDELITY_MEASURES.items():
        lines += [f"### {name}", "", to_markdown(paired_by_ratio(records, subject, value))]
    return lines


def text_type(record: dict) -> str:
    """The text a record's context is made of (`grid.TEXT_TYPES`; a user's suite: its name)."""
    return TEXT_TYPES.get(record["task"], record["task"])


def by_text_type_table(records: list[dict], subject: str) -> list[dict]:
    """`subject` against each method at each ratio, for each text type apart: the paired differences of log answer
    KL, of the expected answer's log-probability and of the answers (each with its 95% interval), and the answers
    of each. A pooled win can hide a collapse on one type (issue #63)."""
    measures = {**FIDELITY_MEASURES, "answers": lambda r: r["correct"]}
    rows = []
    for kind in sorted({text_type(r) for r in records}):
        kept = [r for r in records if text_type(r) == kind]
        answers: dict[tuple[str, float], float] = defaultdict(float)
        for r in kept:
            answers[(r["method"], r["ratio"])] += r["correct"]
        paired = {
            name: {(c["method"], c["ratio"]): c for c in paired_by_ratio(kept, subject, value)}
            for name, value in measures.items()
        }
        for method, ratio in paired["answers"]:
            row = {
                "text": kind,
                "method": method,
                "ratio": ratio,
                "prompts": paired["answers"][(method, ratio)]["prompts"],
            }
            for name in measures:
                cell = paired[name][(method, ratio)]
                difference = cell[f"{subject}_minus_method"]
                row[name] = f"{difference:+.2f} ({cell['low_95']:+.2f}..{cell['high_95']:+.2f})"
            row["answers_of_each"] = f"{answers[(subject, ratio)]:g} / {answers[(method, ratio)]:g}"
            rows.append(row)
    return rows


def _text_type_section(records: list[dict], subject: str) -> list[str]:
    if len({text_type(r) for r in records}) < 2:
        return []
    return [
        f"## {subject} against each method, per text type",
        "",
        "The paired differences of the fidelity section (and of the answers), each text type apart, with their 95% "
        "intervals: decide per type, never pooled. answers_of_each: the subject's, then the method's.",
        "",
        to_markdown(by_text_type_table(records, subject)),
    ]


def write_report(records: list[dict], folder: Path, header: str, subject: str | None = None) -> tuple[list[Path], str]:
    """results.csv (method x ratio x task x length), summary.csv, results.md and the plots; returns the paths and
    the Markdown summary (results.md up to the per-method tables), for the terminal. `subject`: the method whose
    AUC is compared with every other's, paired over prompts (the first method of the run)."""
    records = with_peak_ratios(records)
    table, summary = results_table(records), summary_table(records)
    write_text_atomically(folder / "results.csv", to_csv(table))
    write_text_atomically(folder / "summary.csv", to_csv(summary))
    summary_markdown = "\n".join(
        [
            header,
            "## Summary (all tasks): accuracy, fidelity, prefill time and memory per method and ratio",
            "",
            "accuracy: the answers' mean score (the built-in tasks: every expected value appears; a --suite: its "
            "--scoring); kl: KL divergence (nats) of the first answer token's "
            "distribution from the full cache's; agreement: share of the full cache's first 32 greedy tokens "
            "reproduced before the first difference; prefill_vs_full: median ratio of prefill + compression time to "
            "the full cache's prefill of the same prompt (a run cut from the prompt's shared prefill, the default, "
            "times the shared forward plus its own scoring and cut); peak_mib: median peak resident memory of that "
            "step above the memory before it (measured with --own-prefills); peak_vs_full: median ratio of that peak to the full cache's on the same prompt; cache_kept: KV bytes held over the full cache's; auc: mean accuracy over ratios "
            "0 to the largest (trapezoid through the full cache's accuracy at 0).",
            "",
            to_markdown(summary),
            *_paired_section(records, subject),
        ]
    )
    markdown = "\n".join(
        [
            summary_markdown,
            "## Per method, ratio, task and length",
            "",
            to_markdown(table),
            "![accuracy versus ratio](accuracy_vs_ratio.png)",
            "",
            "![needle-in-a-haystack heatmap](niah_heatmap.png)",
            "",
        ]
    )
    write_text_atomically(folder / "results.md", markdown)
    from kvcompile.evaluation.plots import plot_accuracy_vs_ratio, plot_niah_heatmap

    plot_accuracy_vs_ratio(records, folder / "accuracy_vs_ratio.png")
    plot_niah_heatmap(records, folder / "niah_heatmap.png")
    names = ("results.md", "results.csv", "summary.csv", "accuracy_vs_ratio.png", "niah_heatmap.png")
    return [folder / name for name in names], summary_markdown
