"""Prefill time with and without compression on the default model, as ratios measured in the same run.

    python benchmarks/prefill_overhead.py [--lengths 1000,2000,4000] [--repeats 3] [--out benchmarks/prefill_overhead.md]

For each prompt length, the uncompressed sdpa prefill and the compressed prefills (scoring in every layer plus the
cut of the cache) are timed in turns, `repeats` times each; the table gives medians and the ratio to the
uncompressed prefill of the same length, and the share of the compressed prefill spent in compression.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvruntime
from kvcompile.tasks.passkey import passkey_prompt

sys.path.insert(0, str(Path(__file__).parent))
from reporting import machine  # noqa: E402

METHODS = ("snapkv", "kvcompress")


def timed_prefill(model: torch.nn.Module, ids: torch.Tensor) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=DynamicCache(config=model.config), logits_to_keep=1)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1000,2000,4000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/prefill_overhead.md")
    args = parser.parse_args()
    model, tokenizer = kvruntime.load_model()
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        ids = tokenizer(passkey_prompt(tokenizer, length, 0.5, seed=length).text, return_tensors="pt").input_ids
        timed_prefill(model, ids)  # warm-up
        plain, compressed, shares = [], {m: [] for m in METHODS}, {m: [] for m in METHODS}
        for _ in range(args.repeats):
            plain.append(timed_prefill(model, ids))
            for method in METHODS:
                with kvruntime.compress(model, method, ratio=args.ratio) as session:
                    compressed[method].append(timed_prefill(model, ids))
                report = session.report
                shares[method].append(report.compress_seconds / (report.compress_seconds + report.prefill_seconds))
        base = statistics.median(plain)
        row = [str(ids.shape[1]), f"{base:.2f}"]
        for method in METHODS:
            row += [f"{statistics.median(compressed[method]) / base:.3f}", f"{statistics.median(shares[method]):.1%}"]
        rows.append(row)
        print(" | ".join(row), flush=True)
    header = ["tokens", "sdpa prefill s"]
    for method in METHODS:
        header += [f"{method} / sdpa", f"{method}: compression share"]
    lines = [
        "# Prefill overhead of compression (default model)",
        "",
        f"Command: `python {' '.join(sys.argv)}`  ",
        f"Machine: {machine()}  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; ratio {args.ratio}; "
        f"median of {args.repeats} runs, taken in turns.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "`method / sdpa`: wall time of the compressed prefill over the uncompressed sdpa prefill of the same prompt "
        "(same run). `compression share`: time in window scoring and cache cutting over the compressed prefill.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
