"""One eval run's contestants joined onto another run's prompts, so that `paired_haystacks` pairs them: a contestant
run on part of a bar run's prompts (the same seed, the same count per task) gets the bar run's prompt numbers,
matched by (task, length, depth), after the full cache's answers check that the prompts are the same.

    python -m benchmarks.distilled.join_runs <bar/runs.jsonl> <contestant/runs.jsonl> > joined.jsonl

The prompt numbers differ between runs with other task lists (each task's prompts are numbered after the tasks
before it), while (task, length, depth) names one prompt in both.
"""

from __future__ import annotations

import json
import sys

from benchmarks.reporting import read_records
from kvcompile.evaluation.contestants import FULL


def prompt_key(record: dict) -> tuple:
    return record["task"], record["length"], record["depth"]


def joined(bar: list[dict], contestant: list[dict]) -> list[dict]:
    bar_full = {prompt_key(r): r for r in bar if r["method"] == FULL}
    moved = []
    for record in contestant:
        key = prompt_key(record)
        if key not in bar_full:
            raise SystemExit(f"the bar run has no prompt {key}")
        if record["method"] == FULL:
            if record["answer"] != bar_full[key]["answer"]:
                raise SystemExit(f"prompt {key}: the full cache's answers differ, so the prompts are not the same")
            continue
        moved.append({**record, "prompt": bar_full[key]["prompt"]})
    return bar + moved


def main() -> None:
    for record in joined(*(read_records(path) for path in sys.argv[1:3])):
        print(json.dumps(record, sort_keys=True))


if __name__ == "__main__":
    main()
