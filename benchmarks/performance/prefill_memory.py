"""Peak memory and time of the prefill when the cache is cut inside it (issue 20): every method in the ways it can
run (cut at the end of the prefill, each layer cut right after its attention, the prompt streamed in chunks), and
kvpress's per-layer presses, against the uncompressed prefill of the same round, on the default model.

    python -m benchmarks.performance.prefill_memory [--lengths 2000,4000,8000] [--repeats 2] [--ratio 0.9] [--chunk 512]
        [--only full,distilled:allocation=compiled] [--out benchmarks/performance/prefill_memory.md]

Methods whose layer budgets need every layer's scores (kvcompress's global pool, distilled's dynamic allocation) are
cut at the end of the prefill: their rows show what that path holds. Three measures per run: the largest KV cache held after any attention layer (a hook of this script, registered
before the method's own, so it sees each layer before it is cut), the peak resident memory of the step above the
memory before it (activations and cache: `PeakMemory`), and the process's peak resident memory (weights included).
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.evaluation.contestants import artifact_paths, parse_methods, resolve_contestants
from kvcompile.recipe import artifact_folder
from kvcompile.tasks.passkey import passkey_prompt
from kvruntime.plumbing.cache_ops import cache_bytes, hooked_cache

ARTIFACTS = artifact_folder("default")
MIB = 1 << 20
CHUNKED = (
    "snapkv",
    "compresskv",
    "kvcompose",
    "distilled",  # compiled layer shares, the default since issue #33
    "distilled:allocation=uniform",
    "distilled+budgets",
)
METHODS = (
    "full",
    *CHUNKED,
    "kvcompress",
    "distilled:allocation=dynamic",
    "kvpress-snapkv",
    "kvpress-tova",
    "kvpress-expected_attention",
    "kvpress-streaming_llm",
    "kvpress-pyramidkv",
    "kvpress-keydiff",
    "kvpress-compactor",
)


class LargestCache:
    """The largest KV cache held after any attention layer ran, in bytes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.largest = model, 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[LargestCache]:
        def seen(module, args, kwargs, output) -> None:
            cache = hooked_cache(kwargs)
            self.largest = max(self.largest, cache_bytes(cache))

        self.largest = 0
        modules = [m for m in self.model.modules() if hasattr(m, "q_proj")]
        handles = [m.register_forward_hook(seen, with_kwargs=True) for m in modules]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def process_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2000,4000,8000")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.9)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--only", help="these methods only (and their streamed runs), comma-separated")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/performance/prefill_memory.md"))
    args = parser.parse_args()
    methods = METHODS if args.only is None else ("full", *(m for m in args.only.split(",") if m != "full"))
    chunked = [f"{m}:prefill_chunk_size={args.chunk}" for m in CHUNKED if m in methods]
    contestants = parse_methods(",".join([*methods, *chunked]))
    paths = artifact_paths(contestants, (ARTIFACTS,))
    contestants = resolve_contestants(contestants, paths, (args.ratio,))
    model, tokenizer = kvruntime.load_model()
    largest = LargestCache(model)
    rows = []
    lengths = [int(n) for n in args.lengths.split(",")]
    bar = tqdm(total=len(lengths) * args.repeats * len(contestants), desc="prefill memory", unit="run")
    for length in lengths:
        ids = tokenizer(passkey_prompt(tokenizer, length, 0.5, seed=length).text, return_tensors="pt").input_ids
        with contestants[0].prefilled(model, 0.0, ids, []):  # warm-up
            pass
        measured: dict[str, list[tuple[float, float, float]]] = {}
        for _ in range(args.repeats):
            for contestant in contestants:
                with largest.watching():
                    ratio = args.ratio if contestant.compresses else 0.0
                    with contestant.prefilled(model, ratio, ids, paths.get(contestant.label, [])) as context:
                        step = (context.seconds, context.peak_mib or float("nan"))
                measured.setdefault(contestant.label, []).append((*step, largest.largest))
                bar.update()
        full_seconds, full_step, full_cache = (statistics.median(m) for m in zip(*measured["full"]))
        for label, runs in measured.items():
            seconds, step, cache = (statistics.median(m) for m in zip(*runs))
            rows.append(
                {
                    "tokens": ids.shape[1],
                    "method": label,
                    "time": f"{seconds:.2f} s" if label == "full" else f"{seconds / full_seconds:.2f}x",
                    "KV cache peak": f"{cache / MIB:.1f} MiB" if label == "full" else f"{cache / full_cache:.2f}x",
                    "step peak RSS": f"{step:.0f} MiB" if label == "full" else f"{step / full_step:.2f}x",
                }
            )
    bar.close()
    lines = [
        "# Peak memory and time of the prefill, cut inside it or not (default model)",
        "",
        *run_header(in_venv=True),
        f"Ratio {args.ratio}; pass-key "
        f"prompts; median of {args.repeats} rounds, every method once per round, in turns; process peak RSS "
        f"{process_peak_mib():.0f} MiB (weights included).",
        "",
        *markdown_table(rows),
        "",
        "The full cache's rows give absolute figures; the others their ratio to it in the same round. KV cache "
        "peak: the largest cache held after any attention layer ran (this script's hook sees each layer before it "
        "is cut). Step peak RSS: peak resident memory of the prefill above the memory before it (activations and "
        "cache; the allocator keeps pages between steps, so a few percent are noise).",
    ]
    write_results(rows, args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
