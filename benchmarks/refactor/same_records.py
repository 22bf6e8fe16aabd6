"""Did a restructuring change what `kvcompile eval` measures? Two runs' records compared field by field, the measured
times and memory left aside (they vary from run to run).

    python -m benchmarks.refactor.same_records BEFORE/runs.jsonl AFTER/runs.jsonl --out benchmarks/refactor/<name>.md

Each record is matched by (method, ratio, prompt); every other field must be equal as written (answers, KL, the
reference answer's log-probability, the cache kept). Exits 1 when any differs, naming the first differences."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.reporting import read_records, run_header

MEASURED = ("peak_mib", "prefill_seconds", "prefill_vs_full")  # times and memory: not what the code computes


def keyed_records(path: Path) -> dict[tuple, dict]:
    records = read_records(path)
    return {(r["method"], r["ratio"], r["prompt"]): {k: v for k, v in r.items() if k not in MEASURED} for r in records}


def differences(before: dict[tuple, dict], after: dict[tuple, dict]) -> list[str]:
    """Each run missing on one side, and each field that differs, in the records' order."""
    found = [f"{key}: only before" for key in before if key not in after]
    found += [f"{key}: only after" for key in after if key not in before]
    for key in before.keys() & after.keys():
        for field in sorted(before[key].keys() | after[key].keys()):
            if before[key].get(field) != after[key].get(field):
                found.append(f"{key} {field}: {before[key].get(field)!r} before, {after[key].get(field)!r} after")
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    before, after = keyed_records(args.before), keyed_records(args.after)
    found = differences(before, after)
    methods = sorted({method for method, _, _ in before})
    verdict = "identical" if not found else f"{len(found)} differences"
    lines = [
        "# The same eval records before and after a restructuring",
        "",
        *run_header(),
        f"{len(before)} records before, "
        f"{len(after)} after ({', '.join(methods)}); fields compared: all but {', '.join(MEASURED)}.",
        "",
        f"**{verdict}**",
        *([""] + [f"- {line}" for line in found[:50]] if found else []),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
