"""A saved context against prefilling its document (issue #76): on each model, a pass-key document in held-out prose
(Jekyll and Hyde) of 2k and 8k tokens; the time to the first answer token from a context file (read, checked against
the model and tokenizer, the cache rebuilt, one token decoded) against prefilling and compressing the document with
the one-pass default (`distilled`) and with its two-pass teacher (`scores=oracle`), each then its first token, at
ratio 0.5 (medians of `--repeats` turns, the model loaded once); and the file's bytes against the bytes held and the
full cache's.

    python -m benchmarks.performance.saved_context [--models default,gemma-3-270m] [--lengths 2000,8000]
        [--repeats 3] [--out benchmarks/performance/saved_context.md]
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.recipe import artifact_folder
from kvcompile.tasks.needles import haystack_text
from kvcompile.tasks.passkey import passkey_prompt
from kvcompile.tasks.real_text import held_out_text

RATIO = 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,gemma-3-270m")
    parser.add_argument("--lengths", default="2000,8000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/performance/saved_context.md"))
    args = parser.parse_args()
    rows, folder = [], Path(tempfile.mkdtemp(prefix="saved-context-"))
    one = dict(max_new_tokens=1, do_sample=False)
    for name in args.models.split(","):
        model, tokenizer = kvruntime.load_model(name)
        scorer = artifact_folder(name) / "distilled_scorer.safetensors"
        for length in (int(n) for n in args.lengths.split(",")):
            prose = functools.partial(haystack_text, held_out_text("jekyll"), tokenizer, rng=random.Random(length))
            prompt = passkey_prompt(tokenizer, length, 0.5, haystack=lambda n, prose=prose: prose(n))
            document = tokenizer(prompt.context, return_tensors="pt").input_ids
            question = tokenizer("\n" + prompt.question, return_tensors="pt", add_special_tokens=False).input_ids
            path = folder / f"{name}-{length}.safetensors"
            seconds: dict[str, list[float]] = {"one_pass": [], "teacher": [], "from_file": []}
            with torch.no_grad():
                for _ in range(args.repeats):
                    for label, options in (("one_pass", {}), ("teacher", {"scores": "oracle"})):
                        with kvruntime.compress(
                            model, "distilled", ratio=RATIO, artifacts=[scorer], options=options
                        ) as s:
                            started = time.perf_counter()
                            context = s.prefill(document)
                            context.generate(question, **one)
                            seconds[label].append(time.perf_counter() - started)
                            if label == "one_pass" and not path.exists():
                                kvruntime.save_context(context, path, tokenizer, "raw", "\n")
                                report = context.report
                    started = time.perf_counter()
                    with kvruntime.load_context(model, path, tokenizer) as loaded:
                        loaded.generate(question, **one)
                    seconds["from_file"].append(time.perf_counter() - started)
            median = {label: statistics.median(values) for label, values in seconds.items()}
            mib = 1 << 20
            rows.append({
                "model": name, "tokens": document.shape[1],
                "one_pass_s": round(median["one_pass"], 2), "teacher_s": round(median["teacher"], 2),
                "from_file_s": round(median["from_file"], 3),
                "one_pass_over_file": round(median["one_pass"] / median["from_file"], 1),
                "teacher_over_file": round(median["teacher"] / median["from_file"], 1),
                "file_mib": round(path.stat().st_size / mib, 2), "held_mib": round(report.bytes_after / mib, 2),
                "full_cache_mib": round(report.bytes_before / mib, 2),
                "file_over_held": round(path.stat().st_size / report.bytes_after, 4),
            })  # fmt: skip
        del model
    header = [
        "# A saved context against prefilling its document: time to the first answer token, and the file's size",
        "",
        *run_header(),
        f"Ratio {RATIO}; the context saved from the one-pass "
        "default's compression; medians of the repeats, the model loaded once. `from_file_s`: read, checked (fingerprint, "
        "tokenizer, checksum, finite values, positions), the cache rebuilt and one token decoded.",
        "",
        *markdown_table(rows),
        "",
    ]
    write_results(rows, args.out, "\n".join(header))


if __name__ == "__main__":
    main()
