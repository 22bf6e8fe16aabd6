"""Peak memory of a compile command's corpus steps as the corpus grows: documents stay on disk until indexed.

    python -m benchmarks.calibration.corpus_memory [--sizes 50,200,800] [--out benchmarks/calibration/corpus_memory.md]

For each size (MiB of text) and format, a .jsonl of ~32 KiB rows and a folder of ~1 MiB .txt.gz books of synthetic
text are written to a temporary folder. A fresh process then runs what a compile command does with a corpus:
`load_corpus`, `corpus.sha256`, `len(corpus.documents)` and `calibration_prompts(corpus, tokenizer, 24, 2048, 0)`
with the default model's tokenizer, and reports its peak resident memory during these steps (VmHWM, reset just
before them) above its resident memory before them. For comparison another fresh process also holds every document
in memory, `tuple(corpus.documents)`, as `load_corpus` did before corpora were read lazily (and checks that the hash
is the one of the documents in memory). The temporary folder, datasets cache included, is deleted at the end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.reporting import run_header, write_results

MODULE = "benchmarks.calibration.corpus_memory"
ROOT = Path(__file__).resolve().parents[2]  # the repository root
MIB = 1 << 20
ROW_CHARS = 32 * 1024  # table rows: long enough for 2048-token calibration prompts (16 KiB of text)
BOOK_CHARS = MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,200,800", help="MiB of text per corpus")
    parser.add_argument("--out", default="benchmarks/calibration/corpus_memory.md")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child process: one corpus
    parser.add_argument("--materialise", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.materialise)))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="corpus-memory-") as scratch:
        # The datasets cache (the .jsonl converted to Arrow) goes with the corpora, and is deleted with them.
        cache = str(Path(scratch) / "datasets-cache")
        env = {**os.environ, "HF_DATASETS_CACHE": cache, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        for size in [int(x) for x in args.sizes.split(",")]:
            for kind, write in (("jsonl", write_jsonl), ("txt.gz folder", write_folder)):
                corpus = write(Path(scratch), size)
                lazy, held = child(corpus, env, materialise=False), child(corpus, env, materialise=True)
                assert lazy["sha256"] == held["sha256"]
                rows.append(
                    {
                        "format": kind,
                        "text_mib": size,
                        "documents": lazy["documents"],
                        "rss_before_mib": round(lazy["before"]),
                        "peak_above_before_mib": round(lazy["peak"] - lazy["before"]),
                        "seconds": round(lazy["seconds"], 1),
                        "materialised_peak_above_before_mib": round(held["peak"] - held["before"]),
                    }
                )
                print(rows[-1], flush=True)
                if corpus.is_dir():
                    shutil.rmtree(corpus)
                else:
                    corpus.unlink()
                shutil.rmtree(cache, ignore_errors=True)
    write_results(rows, Path(args.out), render(rows))


def child(corpus: Path, env: dict[str, str], materialise: bool) -> dict:
    # The same module in a fresh interpreter, run from the repository root (as `python -m` runs it).
    command = [sys.executable, "-m", MODULE, "--measure", str(corpus)] + (["--materialise"] if materialise else [])
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def measure(path: Path, materialise: bool) -> dict:
    """In a fresh process: the corpus steps of a compile command, with their peak resident memory in MiB."""
    import datasets  # noqa: F401  (loaded before the baseline, as in a compile command)
    from transformers import AutoTokenizer

    from kvcompile.calibration.corpus import Corpus, calibration_prompts, load_corpus
    from kvruntime.models.default_model import DEFAULT_MODEL, load_shipped_model

    _, tokenizer = load_shipped_model(
        DEFAULT_MODEL, lambda folder: (None, AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    )
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the resident memory now
    before = status_mib("VmRSS")
    start = time.perf_counter()
    corpus = load_corpus(path)
    result = {"sha256": corpus.sha256, "documents": len(corpus.documents)}
    if materialise:
        held = tuple(corpus.documents)
        assert Corpus(corpus.name, held).sha256 == corpus.sha256
    calibration_prompts(corpus, tokenizer, 24, 2048, 0)
    return {**result, "seconds": time.perf_counter() - start, "before": before, "peak": status_mib("VmHWM")}


def status_mib(field: str) -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def synthetic_documents(mib: int, chars: int) -> Iterator[str]:
    """Documents of `chars` characters of random words, numbered, until `mib` MiB of text."""
    rng = random.Random(0)
    words = ["".join(rng.choices("etaoinshrdlucmfwyp", k=rng.randint(2, 9))) for _ in range(5000)]
    paragraphs = [" ".join(rng.choices(words, k=700)) + ".\n\n" for _ in range(64)]  # reused: text is cheap to write
    for number in range(mib * MIB // chars):
        parts, length = [f"Document {number}.\n\n"], 0
        while length < chars:
            parts.append(rng.choice(paragraphs))
            length += len(parts[-1])
        yield "".join(parts)[:chars]


def write_jsonl(folder: Path, mib: int) -> Path:
    path = folder / f"corpus-{mib}.jsonl"
    with open(path, "w") as handle:
        for document in synthetic_documents(mib, ROW_CHARS):
            handle.write(json.dumps({"text": document}) + "\n")
    return path


def write_folder(folder: Path, mib: int) -> Path:
    books = folder / f"corpus-{mib}"
    books.mkdir()
    for number, document in enumerate(synthetic_documents(mib, BOOK_CHARS)):
        (books / f"book-{number:05}.txt.gz").write_bytes(gzip.compress(document.encode(), compresslevel=1))
    return books


def render(rows: list[dict]) -> str:
    import datasets

    memory = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    lines = [
        "# Peak memory of the corpus steps of a compile command, as the corpus grows",
        "",
        *run_header(),
        f"datasets {datasets.__version__}, {int(memory.split()[1]) // 1024} MiB RAM. Steps: `load_corpus`, "
        "`corpus.sha256`, `len(corpus.documents)`, `calibration_prompts(corpus, tokenizer, 24, 2048, 0)` with the "
        "default model's tokenizer, in a fresh process; peak resident memory (VmHWM) above the resident memory before "
        "them (heap freed before them and reused is not counted again: small figures are low by up to ~15 MiB, "
        "reading one 1 MiB book takes about 3 MiB at once). The .jsonl runs include its one-time conversion to Arrow in the datasets cache. Materialised: the same "
        "steps holding every document in memory, as corpora were loaded before (for the .jsonl this also counts the "
        'pages of the memory-mapped Arrow file that reading every row touches, as the old `table["text"]` did).',
        "",
        "| format | text | documents | memory before | peak above it | time | materialised: peak above it |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['text_mib']} MiB | {r['documents']} | {r['rss_before_mib']} MiB | "
            f"{r['peak_above_before_mib']} MiB | {r['seconds']} s | {r['materialised_peak_above_before_mib']} MiB |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
