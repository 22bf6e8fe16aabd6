"""What every benchmark writes besides its numbers: the machine it ran on, and its rows as CSV beside the table."""

from __future__ import annotations

import csv
import datetime
import json
import shlex
import sys
from pathlib import Path

from kvcompile.evaluation.measure import machine  # noqa: F401  (re-exported for the benchmark scripts)


def command_line(in_venv: bool = False) -> str:
    """The command that ran this script, as it reruns from the repository root: `python -m benchmarks.<study>.<script>
    <arguments>` (with `in_venv`, the venv's python: `.venv-bench/bin/python -m ...`)."""
    python = f"{Path(sys.executable).parent.parent.name}/bin/python" if in_venv else "python"
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    target = ["-m", spec.name] if spec is not None and spec.name else [sys.argv[0]]
    return " ".join([python, *target, shlex.join(sys.argv[1:])]).rstrip()


def run_header(in_venv: bool = False) -> list[str]:
    """The lines every report opens with after its title: the command that reruns it (`command_line`), the machine
    it ran on and when (Markdown line breaks between them)."""
    return [
        f"Command: `{command_line(in_venv)}`  ",
        f"Machine: {machine()}  ",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.  ",
    ]


def read_records(path: str | Path) -> list[dict]:
    """An eval run's records (`runs.jsonl`: one JSON object per line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_results(rows: list[dict], out: Path, markdown: str, quiet: bool = False) -> None:
    """The rows as `<out>.csv`, the rendered table as `out`; the table is printed too (unless `quiet`: partial
    results written as a long run goes)."""
    with open(out.with_suffix(".csv"), "w", newline="") as handle:
        fields = list(dict.fromkeys(key for row in rows for key in row))  # rows of several kinds: every column
        writer = csv.DictWriter(handle, fieldnames=fields)
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
