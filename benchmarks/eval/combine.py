"""One report from several `kvcompile eval` runs of the same prompts: methods measured in separate runs compared as
if they had run together (greedy decoding is deterministic, so a method's answer to a prompt does not depend on the
run), paired over prompts with the bootstrap intervals `kvcompile eval` writes.

    python -m benchmarks.eval.combine RUN_DIR [RUN_DIR ...] --subject METHOD --out DIR [--ratios 0.75,0.9]
        [--methods M1,M2,...] [--common-prompts]

The runs must share the suite (tasks, lengths, samples, seed, prompt format, question mode, answer length); the
full cache's answers must agree wherever two runs hold them (checked). `--ratios` keeps the ratios every method was
run at, so that the AUCs are over the same points; `--methods` keeps those methods (and the full cache);
`--common-prompts` keeps the prompts every method answered at every ratio (a run stopped part way compared on the
prompts it reached).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.reporting import run_header
from kvcompile.evaluation.contestants import FULL
from kvcompile.evaluation.report import write_report

SUITE_KEYS = ("tasks", "lengths", "samples", "seed", "prompt_format", "question_aware", "new_tokens", "model")


def combined_records(folders: list[Path], ratios: set[float] | None, methods: set[str] | None) -> list[dict]:
    settings = [json.loads((folder / "run.json").read_text()) for folder in folders]
    for folder, other in zip(folders[1:], settings[1:]):
        differing = [key for key in SUITE_KEYS if other.get(key) != settings[0].get(key)]
        if differing:
            raise SystemExit(f"{folder} ran another suite than {folders[0]}: {', '.join(differing)} differ")
    records, full, seen = [], {}, set()
    for folder in folders:
        for line in (folder / "runs.jsonl").read_text().splitlines():
            record = json.loads(line)
            key = (record["method"], record["prompt"], record["ratio"])
            if record["method"] == FULL:
                if full.setdefault(record["prompt"], record["correct"]) != record["correct"]:
                    raise SystemExit(f"the full cache answered prompt {record['prompt']} differently in two runs")
            elif ratios is not None and record["ratio"] not in ratios:
                continue
            elif methods is not None and record["method"] not in methods:
                continue
            if key not in seen:
                seen.add(key)
                records.append(record)
    return records


def on_common_prompts(records: list[dict]) -> list[dict]:
    """The records of the prompts that every method holds at every ratio it was run at (the full cache included)."""
    cells = {(r["method"], r["ratio"]) for r in records}
    held: dict[object, set] = {}
    for record in records:
        held.setdefault(record["prompt"], set()).add((record["method"], record["ratio"]))
    return [r for r in records if held[r["prompt"]] == cells]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--subject", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ratios", type=lambda text: {float(r) for r in text.split(",")})
    parser.add_argument("--methods", type=lambda text: set(text.split(",")))
    parser.add_argument("--common-prompts", action="store_true")
    args = parser.parse_args()
    records = combined_records(args.runs, args.ratios, args.methods)
    if args.common_prompts:
        records = on_common_prompts(records)
    args.out.mkdir(parents=True, exist_ok=True)
    header = "\n".join(
        [
            "# Combined kvcompile eval runs",
            "",
            *run_header(),
            "",
            # Each run's report, linked from where this one is written.
            "Runs: " + ", ".join(f"[{run}]({os.path.relpath(run / 'results.md', args.out)})" for run in args.runs),
            "",
        ]
    )
    _, summary = write_report(records, args.out, header, args.subject)
    print(summary)


if __name__ == "__main__":
    main()
