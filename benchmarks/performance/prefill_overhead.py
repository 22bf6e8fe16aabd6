"""Prefill time and peak memory of every method against the uncompressed sdpa prefill, as ratios measured in the
same run, on one model (the default model unless `--model` names another): kvcompile's methods and, with the `bench` extra, kvpress's presses.

    python -m benchmarks.performance.prefill_overhead [--model default] [--lengths 1000,2000,4000] [--repeats 3]
        [--ratio 0.5] [--methods ...] [--out benchmarks/performance/prefill_overhead.md]

For each prompt length (a pass-key prompt), the uncompressed prefill and each method's prefill + compression run
in turns, `repeats` times; the table gives, per method and length, the median wall time and the median peak
resident memory of the step (above the memory before it) over the full cache's of the same round.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import kvruntime
from benchmarks.reporting import run_header
from kvcompile.evaluation.contestants import artifact_paths, default_methods, parse_methods, resolve_contestants
from kvcompile.recipe import artifact_folder
from kvcompile.tasks.passkey import passkey_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", default="1000,2000,4000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--methods", default=None, help="as kvcompile eval --methods (default: all available)")
    parser.add_argument("--out", default="benchmarks/performance/prefill_overhead.md")
    args = parser.parse_args()
    contestants = parse_methods(args.methods or default_methods())
    paths = artifact_paths(contestants, (artifact_folder(args.model),))
    contestants = resolve_contestants(contestants, paths, (args.ratio,))
    model, tokenizer = kvruntime.load_model(args.model)
    lengths, cells = [], {}
    for length in (int(n) for n in args.lengths.split(",")):
        ids = tokenizer(passkey_prompt(tokenizer, length, 0.5, seed=length).text, return_tensors="pt").input_ids
        lengths.append(ids.shape[1])
        with contestants[0].prefilled(model, 0.0, ids, []):  # warm-up
            pass
        seconds = {c.label: [] for c in contestants}
        peaks = {c.label: [] for c in contestants}
        for _ in range(args.repeats):
            for contestant in contestants:
                ratio = args.ratio if contestant.compresses else 0.0
                with contestant.prefilled(model, ratio, ids, paths.get(contestant.label, [])) as context:
                    seconds[contestant.label].append(context.seconds)
                    peaks[contestant.label].append(context.peak_mib or float("nan"))
            full_seconds, full_peak = seconds["full"][-1], peaks["full"][-1]
            for label in seconds:  # ratios to the full cache of the same round
                seconds[label][-1] /= full_seconds if label != "full" else 1.0
                peaks[label][-1] /= full_peak if label != "full" else 1.0
        for label in seconds:
            cells[(label, ids.shape[1])] = (statistics.median(seconds[label]), statistics.median(peaks[label]))
        print(f"{ids.shape[1]} tokens done", flush=True)
    header = ["method"] + [f"{n} tokens: {what}" for n in lengths for what in ("time", "peak memory")]
    rows = []
    for contestant in contestants:
        row = [contestant.label]
        for n in lengths:
            time_ratio, peak_ratio = cells[(contestant.label, n)]
            if not contestant.compresses:
                row += [f"{time_ratio:.2f} s", f"{peak_ratio:.0f} MiB"]
            else:
                row += [f"{time_ratio:.2f}x", f"{peak_ratio:.2f}x"]
        rows.append(row)
    lines = [
        f"# Prefill time and peak memory of each method against the uncompressed sdpa prefill ({args.model} model)",
        "",
        *run_header(in_venv=True),
        f"Ratio {args.ratio}; pass-key "
        f"prompts; median of {args.repeats} rounds, every method once per round, in turns.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "The full cache's row gives absolute figures (seconds of the sdpa prefill, MiB of peak resident memory above "
        "the memory before the step: activations and the KV cache); the other rows give their ratio to it, measured in "
        "the same round. Peak memory is a resident-set measure (the allocator keeps pages between steps), so "
        "differences of a few percent are noise; at 4k tokens the quadratic work of the two-pass scorers shows.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
