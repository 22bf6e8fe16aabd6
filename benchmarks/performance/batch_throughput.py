"""Batches (issue 36): prompts per second and peak memory of `model.generate` on batches of 1, 4 and 8 prompts of
about 2k tokens, compressed at two ratios against the uncompressed batch of the same size, in one run, as ratios;
and the largest batch that fits a memory budget with and without compression (from a line fitted to the measured
peaks: what the memory compression frees buys in batch size).

    python -m benchmarks.performance.batch_throughput [--batches 1,4,8] [--ratios 0.5,0.9] [--method kvcompress]
        [--tokens 2048] [--new-tokens 32] [--memory-budget-mib 2048] [--out benchmarks/performance/batch_throughput.md]

The prompts are windows of a shipped book, each a few tokens shorter than the one before (so that a batch is
padded). The uncompressed batch prefills all rows at once (transformers' sdpa); a compressed batch prefills row by
row (each row compressed as it would be alone) and decodes at once.
"""

from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import DynamicCache

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.evaluation.measure import PeakMemory
from kvruntime.plumbing.batch_rows import left_pad
from kvruntime.plumbing.cache_ops import cache_argument, cache_bytes

BOOK = Path("calibration_data/books/austen_persuasion.txt.gz")
MIB = 1 << 20


def book_prompts(tokenizer, count: int, tokens: int) -> list[torch.Tensor]:
    """`count` windows of the book, row i `tokens - 16 i` tokens long, from different places."""
    ids = tokenizer(gzip.open(BOOK, "rt", encoding="utf-8").read(), add_special_tokens=False).input_ids
    stride = (len(ids) - tokens) // count
    return [torch.tensor(ids[i * stride : i * stride + tokens - 16 * i]) for i in range(count)]


def run(model, ids, mask, new_tokens: int, method: str | None, ratio: float | None) -> dict:
    cache = DynamicCache(config=model.config)
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with PeakMemory() as peak:
        started = time.perf_counter()
        if method is None:
            model.generate(input_ids=ids, attention_mask=mask, **cache_argument(model, cache), **greedy)
        else:
            with kvruntime.compress(model, method, ratio=ratio):
                model.generate(input_ids=ids, attention_mask=mask, **cache_argument(model, cache), **greedy)
        seconds = time.perf_counter() - started
    return dict(seconds=seconds, peak_mib=peak.mib, kv_mib=cache_bytes(cache) / MIB)


def largest_batch(batches: list[int], peaks: list[float], budget: float) -> tuple[int, float, float]:
    """The largest batch whose peak fits `budget` on the line fitted to the measured (batch, peak) points, with the
    line's intercept and slope (MiB, MiB per prompt)."""
    slope, intercept = np.polyfit(batches, peaks, 1)
    return int((budget - intercept) // slope) if slope > 0 else 0, float(intercept), float(slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--ratios", default="0.5,0.9")
    parser.add_argument("--method", default="kvcompress")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--memory-budget-mib", type=float, default=2048.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/performance/batch_throughput.md"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    model, tokenizer = kvruntime.load_model()
    prompts = book_prompts(tokenizer, max(batches), args.tokens)
    configs = [("uncompressed", None, None)] + [(f"{args.method} {r}", args.method, r) for r in ratios]
    ids, mask = left_pad(prompts[:1], 0)
    run(model, ids[:, :256], mask[:, :256], 2, None, None)  # warm-up: first-call costs out of the figures
    rows = []
    with tqdm(total=len(batches) * len(configs), desc="batches", unit="run") as bar:
        for batch in batches:
            ids, mask = left_pad(prompts[:batch], 0)
            for name, method, ratio in configs:  # every configuration of a batch size in the same turn
                result = run(model, ids, mask, args.new_tokens, method, ratio)
                rows.append(dict(config=name, batch=batch, prompts_per_second=batch / result["seconds"], **result))
                bar.update()
    base = {row["batch"]: row for row in rows if row["config"] == "uncompressed"}
    table = []
    for row in rows:
        full = base[row["batch"]]
        table.append(
            {
                "configuration": row["config"],
                "batch": row["batch"],
                "prompts per second": f"{row['prompts_per_second']:.3f}",
                "vs uncompressed": f"{row['prompts_per_second'] / full['prompts_per_second']:.2f}x",
                "peak memory (MiB)": f"{row['peak_mib']:.0f}",
                "peak vs uncompressed": f"{row['peak_mib'] / full['peak_mib']:.2f}x",
                "KV held at the end (MiB)": f"{row['kv_mib']:.1f}",
            }
        )
    fits = []
    for name, _, _ in configs:
        mine = [row for row in rows if row["config"] == name]
        largest, intercept, slope = largest_batch(
            [row["batch"] for row in mine], [row["peak_mib"] for row in mine], args.memory_budget_mib
        )
        fits.append(
            {
                "configuration": name,
                "peak = a + b x batch: a (MiB)": f"{intercept:.0f}",
                "b (MiB per prompt)": f"{slope:.1f}",
                f"largest batch within {args.memory_budget_mib:.0f} MiB": largest,
            }
        )
    lengths = f"{prompts[max(batches) - 1].numel()}-{prompts[0].numel()}"
    markdown = "\n".join(
        [
            "# Batches: prompts per second and peak memory, compressed and not (default model)",
            "",
            *run_header(),
            f"Prompts: windows of "
            f"{BOOK.name} of {lengths} tokens (left-padded), {args.new_tokens} new tokens each (greedy); one run per "
            "cell, every configuration of a batch size in the same turn. Peak memory: resident memory of the "
            "generate call above the memory before it (activations and cache).",
            "",
            *markdown_table(table),
            "",
            "## The largest batch within a memory budget",
            "",
            "A line fitted to the measured peaks of each configuration, solved for the budget (an extrapolation "
            "beyond the largest batch measured).",
            "",
            *markdown_table(fits),
            "",
        ]
    )
    write_results(rows, args.out, markdown)


if __name__ == "__main__":
    main()
