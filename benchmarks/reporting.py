"""What every benchmark writes besides its numbers: the machine it ran on, and its rows as CSV beside the table."""

from __future__ import annotations

import csv
from pathlib import Path

from kvcompile.evaluation.measure import machine  # noqa: F401  (re-exported for the benchmark scripts)


def write_results(rows: list[dict], out: Path, markdown: str, quiet: bool = False) -> None:
    """The rows as `<out>.csv`, the rendered table as `out`; the table is printed too (unless `quiet`: partial
    results written as a long run goes)."""
    with open(out.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out.write_text(markdown)
    if not quiet:
        print(markdown)


def markdown_table(rows: list[dict]) -> list[str]:
    """The rows as the lines of a Markdown table (a header from the first row's keys)."""
    columns = list(rows[0])
    return [
        "| " + " | ".join(columns) + " |",
        "|---" * len(columns) + "|",
        *("| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows),
    ]
