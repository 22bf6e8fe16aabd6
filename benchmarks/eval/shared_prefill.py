"""`kvcompile eval` with one prefill per prompt shared by every contestant (`--shared-prefill`, the default) against
every contestant's own prefill (`--own-prefills`): the wall time of the same suite both ways, in one process on the
default model, and whether the records are the same but for the prefill's timing and memory.

    .venv-bench/bin/python -m benchmarks.eval.shared_prefill [--methods full,distilled,kvpress-compactor,kvpress-kvzap]
        [--tasks passkey,passkey_prose,needle,multikey] [--lengths 1k,2k,4k] [--samples 1] [--seed 2]
        [--out benchmarks/eval/shared_prefill.md]

The defaults are the settings of the 60-prompt suite (benchmarks/distilled/runs/eval_sixty: its tasks, lengths, ratios,
16 new tokens, seed 2) at one prompt per task and length, with the methods issue #49 compares.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.evaluation.contestants import artifact_paths, parse_methods, resolve_contestants
from kvcompile.evaluation.settings import SuiteSettings
from kvcompile.evaluation.store import RunStore
from kvcompile.evaluation.suite_run import evaluate
from kvcompile.recipe import artifact_folder
from kvcompile.tasks.grid import parse_lengths

ARTIFACTS = artifact_folder("default")
# What differs between the two ways by design: the prefill's timing and memory, and how it was made.
PREFILL_FIELDS = {"prefill_seconds", "prefill_vs_full", "peak_mib", "prefill"}


def run(model, tokenizer, contestants, paths, settings: SuiteSettings, shared: bool) -> tuple[float, list[dict]]:
    with tempfile.TemporaryDirectory() as folder:
        store = RunStore(Path(folder) / "run", {"shared": shared}, resume=False)
        started = time.perf_counter()
        records = evaluate(model, tokenizer, contestants, paths, settings, store, shared_prefills=shared)
        return time.perf_counter() - started, records


def differences(own: list[dict], shared: list[dict]) -> list[str]:
    """The (prompt, method, ratio, field) whose values differ, beyond the prefill's fields."""
    by_key = {(r["prompt"], r["method"], r["ratio"]): r for r in shared}
    found = []
    for record in own:
        other = by_key.get((record["prompt"], record["method"], record["ratio"]), {})
        found += [
            f"{record['prompt']} {record['method']} {record['ratio']} {field}"
            for field in record
            if field not in PREFILL_FIELDS and other.get(field) != record[field]
        ]
    return found + ([] if len(own) == len(shared) else [f"{len(own)} records against {len(shared)}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="full,distilled,kvpress-compactor,kvpress-kvzap")
    parser.add_argument("--tasks", default="passkey,passkey_prose,needle,multikey")
    parser.add_argument("--lengths", default="1k,2k,4k")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/eval/shared_prefill.md")
    args = parser.parse_args()
    settings = SuiteSettings(
        ratios=(0.5, 0.75, 0.9),
        tasks=tuple(args.tasks.split(",")),
        lengths=tuple(parse_lengths(args.lengths)),
        samples=args.samples,
        seed=args.seed,
        question_aware=False,
        new_tokens=16,
    )
    settings.check()
    contestants = parse_methods(args.methods)
    paths = artifact_paths(contestants, (ARTIFACTS,))
    contestants = resolve_contestants(contestants, paths, settings.ratios)
    model, tokenizer = kvruntime.load_model()
    own_seconds, own = run(model, tokenizer, contestants, paths, settings, shared=False)
    shared_seconds, shared = run(model, tokenizer, contestants, paths, settings, shared=True)
    differing = differences(own, shared)
    prompts = len({r["prompt"] for r in own})
    rows = [
        dict(
            prefill=way,
            prompts=prompts,
            runs=len(records),
            seconds=round(seconds, 1),
            seconds_per_prompt=round(seconds / prompts, 2),
            speed_up=round(own_seconds / seconds, 2),
        )
        for way, seconds, records in (("own", own_seconds, own), ("shared", shared_seconds, shared))
    ]
    verdict = (
        "The records are the same but for the prefill's timing and memory."
        if not differing
        else f"{len(differing)} values differ: " + "; ".join(differing[:10])
    )
    markdown = "\n".join(
        [
            "# kvcompile eval: one prefill per prompt shared by every contestant, against each contestant's own",
            "",
            *run_header(in_venv=True),
            f"Suite: {prompts} prompts ({', '.join(settings.tasks)}; lengths {args.lengths}; seed {args.seed}), "
            f"methods {args.methods}, ratios {', '.join(map(str, settings.ratios))}, 16 new tokens; "
            f"{settings.samples} per task and length. Both ways in one process, own first.",
            "",
            *markdown_table(rows),
            "",
            verdict,
            "",
        ]
    )
    write_results(rows, Path(args.out), markdown)
    if differing:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
