"""An eval run's fidelity pairs split by text type (repeated filler, Moby-Dick, code, documentation, Jekyll and
Hyde: `kvcompile.tasks.grid.TEXT_TYPES`), for runs recorded before the eval's report had that section: per ratio, a
subject method minus each other method in log answer KL, in the expected answer's log-probability and in answers
(95% bootstrap intervals, as the eval's report), with the answers of each.

    python -m benchmarks.distilled.paired_haystacks <runs.jsonl> <subject> [label=short ...]
"""

from __future__ import annotations

import sys

from benchmarks.reporting import read_records
from kvcompile.evaluation.report import by_text_type_table, to_markdown


def main() -> None:
    path, subject, *renames = sys.argv[1:]
    names = dict(pair.split("=", 1) for pair in renames)
    rows = by_text_type_table(read_records(path), subject)
    print(to_markdown([{**row, "method": names.get(row["method"], row["method"])} for row in rows]), end="")


if __name__ == "__main__":
    main()
