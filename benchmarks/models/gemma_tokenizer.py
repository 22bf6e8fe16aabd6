"""Gemma's tokenizer as kvruntime builds it from the GGUF against transformers' own GGUF converter (issue #77: 5.2's
converter renamed a byte token, so the cache failed its check at every load; kvruntime now builds it itself, as it
builds SmolLM2's). Every shipped text (books, held-out code, docs and prose, prompts), encoded by both, token for
token, in pieces of 4,000 characters; and the same decoded back.

    python -m benchmarks.models.gemma_tokenizer --out benchmarks/models/gemma_tokenizer.md

Run it in a venv whose transformers converts Gemma right (5.23, `.venv`): there the two must agree everywhere."""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from benchmarks.reporting import markdown_table, run_header, write_results
from kvruntime.models.default_model import gguf_of
from kvruntime.models.gguf_tokenizer import build_tokenizer, read_gguf_tokenizer

PIECE = 4000  # characters per encoded piece
ROOT = Path(__file__).resolve().parents[2]


def shipped_texts() -> dict[str, str]:
    texts = {}
    for path in sorted((ROOT / "calibration_data").rglob("*")):
        if path.suffix == ".gz":
            texts[path.name] = gzip.decompress(path.read_bytes()).decode("utf-8")
        elif path.suffix == ".txt":
            texts[path.name] = path.read_text(encoding="utf-8")
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gguf = gguf_of("gemma-3-270m")
    spec = read_gguf_tokenizer(gguf)
    built = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(spec))
    converted = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    rows = []
    for name, text in shipped_texts().items():
        pieces = [text[start : start + PIECE] for start in range(0, len(text), PIECE)]
        ours = built(pieces, add_special_tokens=False).input_ids
        theirs = converted(pieces, add_special_tokens=False).input_ids
        differing = sum(a != b for a, b in zip(ours, theirs))
        decoded = sum(built.decode(ids) != piece for ids, piece in zip(ours, pieces))
        rows.append(
            dict(
                text=name,
                pieces=len(pieces),
                tokens=sum(map(len, ours)),
                pieces_encoded_differently=differing,
                pieces_not_decoded_back=decoded,
            )
        )
    total = {key: sum(row[key] for row in rows) for key in rows[0] if key != "text"}
    rows.append({"text": "all", **total})
    lines = [
        "# Gemma 3 270M's tokenizer: built from the GGUF against transformers' converter",
        "",
        *run_header(),
        f"transformers {transformers.__version__}. Each shipped text in pieces of {PIECE:,} characters, encoded without "
        "special tokens by both; `pieces_not_decoded_back`: pieces the built tokenizer does not decode back to the "
        "same text.",
        "",
        *markdown_table(rows),
        "",
    ]
    write_results(rows, args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
