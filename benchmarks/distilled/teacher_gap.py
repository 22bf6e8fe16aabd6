"""The teacher gap before and after, on the same prompts of two eval runs (issue #74's "half today's or less"): per
ratio, and per task, a subject method minus its teacher in log answer KL in each run, and the subject now minus the
subject before, paired by prompt (task, length, depth) with 95% bootstrap intervals, as the eval's report pairs.

    python -m benchmarks.distilled.teacher_gap <now/runs.jsonl> <before/runs.jsonl> [--tasks passkey_prose,needle]

The two runs must hold the same prompts (the same seed and count per task: the depths spread over the count), which
the full cache's answers check.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.reporting import read_records
from kvcompile.evaluation.contestants import FULL
from kvcompile.evaluation.metrics import bootstrap_interval
from kvcompile.evaluation.report import FIDELITY_MEASURES, to_markdown

LOG_KL = FIDELITY_MEASURES["log_answer_kl"]


def by_prompt(records: list[dict], method: str, tasks: set[str] | None) -> dict[tuple, dict]:
    return {
        (r["task"], r["length"], r["depth"], r["ratio"]): r
        for r in records
        if r["method"] == method and (tasks is None or r["task"] in tasks)
    }


def cell(differences: list[float]) -> str:
    low, high = bootstrap_interval(differences)
    return f"{statistics.mean(differences):+.2f} ({low:+.2f}..{high:+.2f})"


def gap_rows(now: list[dict], before: list[dict], subject: str, teacher: str, tasks: set[str] | None) -> list[dict]:
    full_now, full_before = by_prompt(now, FULL, tasks), by_prompt(before, FULL, tasks)
    if any(full_now.get(key, {}).get("answer") != record["answer"] for key, record in full_before.items()):
        raise SystemExit("the two runs do not hold the same prompts (the full cache's answers differ)")
    runs = {
        name: (by_prompt(records, subject, tasks), by_prompt(records, teacher, tasks))
        for name, records in (("now", now), ("before", before))
    }
    keys = sorted(set(runs["now"][0]) & set(runs["now"][1]) & set(runs["before"][0]) & set(runs["before"][1]))
    if not keys:
        raise SystemExit(f"no prompt has {subject} and {teacher} at one ratio in both runs")
    rows = []
    for scope in ["all", *sorted({key[0] for key in keys})]:
        for ratio in sorted({key[3] for key in keys}):
            chosen = [k for k in keys if k[3] == ratio and scope in ("all", k[0])]
            gaps = {
                name: [LOG_KL(student[k]) - LOG_KL(teacher_records[k]) for k in chosen]
                for name, (student, teacher_records) in runs.items()
            }
            rows.append(
                {
                    "task": scope,
                    "ratio": ratio,
                    "prompts": len(chosen),
                    "gap_before": cell(gaps["before"]),
                    "gap_now": cell(gaps["now"]),
                    "now_minus_before": cell(
                        [LOG_KL(runs["now"][0][k]) - LOG_KL(runs["before"][0][k]) for k in chosen]
                    ),
                    "answers_before_now": f"{sum(runs['before'][0][k]['correct'] for k in chosen):g} / "
                    f"{sum(runs['now'][0][k]['correct'] for k in chosen):g}",
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("now")
    parser.add_argument("before")
    parser.add_argument("--subject", default="distilled")
    parser.add_argument("--teacher", default="distilled:scores=oracle")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks (default: every task of both runs)")
    args = parser.parse_args()
    runs = [read_records(path) for path in (args.now, args.before)]
    tasks = set(args.tasks.split(",")) if args.tasks else None
    print(to_markdown(gap_rows(*runs, args.subject, args.teacher, tasks)), end="")


if __name__ == "__main__":
    main()
