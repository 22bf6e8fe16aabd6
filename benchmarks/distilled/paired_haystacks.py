"""An eval run's fidelity pairs split by haystack: per ratio, a subject method minus each other method in log answer
KL and in the expected answer's log-probability (95% bootstrap intervals, as the eval's report), on all prompts,
on the repeated-filler ones and on the prose ones, with the answers of each.

    python -m benchmarks.distilled.paired_haystacks <runs.jsonl> <subject> [label=short ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from kvcompile.evaluation.report import FIDELITY_MEASURES, paired_by_ratio

FILLER_TASKS = {"passkey", "needle_filler", "multikey_filler"}


def main() -> None:
    path, subject, *renames = sys.argv[1:]
    names = dict(pair.split("=", 1) for pair in renames)
    with open(path) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    parts = {
        "all": lambda r: True,
        "filler": lambda r: r["task"] in FILLER_TASKS,
        "prose": lambda r: r["task"] not in FILLER_TASKS,
    }
    for part, keep in parts.items():
        kept = [r for r in records if keep(r)]
        print(f"== {part} ({len({r['prompt'] for r in kept})} prompts)")
        answers: dict[tuple[str, float], float] = defaultdict(float)
        for r in kept:
            answers[(r["method"], r["ratio"])] += r["correct"]
        for measure, value in FIDELITY_MEASURES.items():
            for row in paired_by_ratio(kept, subject, value):
                method, ratio = names.get(row["method"], row["method"]), row["ratio"]
                print(
                    f"  {measure:15s} {method:12s} {ratio}: {row[subject + '_minus_method']:+.2f} "
                    f"({row['low_95']:+.2f}..{row['high_95']:+.2f})  answers {answers[(subject, ratio)]:g} against "
                    f"{answers[(row['method'], ratio)]:g}"
                )


if __name__ == "__main__":
    main()
