"""What every benchmark writes besides its numbers: the machine it ran on, and its rows as CSV beside the table."""

from __future__ import annotations

import csv
import platform
from pathlib import Path

import torch
import transformers


def machine() -> str:
    cpu = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return (
        f"{platform.node()}: {cpu}, {torch.get_num_threads()} torch threads, Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )


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
