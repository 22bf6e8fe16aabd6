"""Calibration text: the shipped public-domain books by default, or any local text the user points at
(a .txt/.txt.gz file, a folder of them, or a datasets-loadable .jsonl/.json/.parquet/.csv with a `text` column).

Loaded documents stay on disk and are read when indexed, so a corpus need not fit in memory: loading makes one pass,
one document in memory at a time, that checks every document, skips blank ones, and notes lengths and the hash.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import itertools
import random
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompile.shipped import shipped_folder
from kvruntime import KVRuntimeError
from kvruntime.errors import first_line

if TYPE_CHECKING:
    import datasets
    import torch
    from transformers import PreTrainedTokenizerBase

DEFAULT_CORPUS = "austen"  # the six Austen novels: calibration only; Moby Dick is kept for evaluation
REPEATING_CORPUS = "austen-repeats"  # the novels and two documents of repeated Austen sentences (`kvcompile distill`)
MIXED_CORPUS = "mixed"  # austen-repeats and `calibration_data/mixed/`: code, software documentation, math docstrings
FACTS_CORPUS = "austen-facts"  # austen-repeats with facts (figures, names, codes) set inside the novels' running text
# austen-facts whose facts come in runs of four of one template, values apart: alike sentences whose values differ
RECORDS_CORPUS = "austen-records"
RECORD_RUN = 4
HELD_OUT_CORPUS = "moby-dick"  # evaluation and tuning text, never calibration
BOOK_CORPORA = (DEFAULT_CORPUS, REPEATING_CORPUS, MIXED_CORPUS, FACTS_CORPUS, RECORDS_CORPUS)  # the Austen novels'
SHIPPED_CORPORA = (*BOOK_CORPORA, HELD_OUT_CORPUS)  # named, not paths
# Facts as a prompt holds them inside prose: figures, names and codes a question may ask for. Their wording shares
# nothing with the evaluation's needles (`kvcompile.tasks`), so that no compile reads what the eval asks.
FACT_TEMPLATES = (
    "The ledger of {place} entered the sum under number {number}.",
    "{name} wrote the figure {number} on the back of the letter.",
    "The carriage from {place} bore the mark {code}.",
    "Her room at the inn at {place} was number {small}, and the key was tagged {code}.",
    "The receipt signed by {name} read {small} pounds and {tiny} shillings.",
    "By the parish register, {name} was born in the year {year} at {place}.",
    "The parcel for {name} was sent to {place} under the reference {code}.",
    "{name} kept the combination {number} in a locked drawer at {place}.",
)
FACT_NAMES = ("Mr. Pemberton", "Miss Ashford", "Colonel Drayton", "Mrs. Whitcombe", "Lady Harcourt", "Captain Leveson")
FACT_PLACES = ("Bramley", "Kingsworth", "Halstead Green", "Lower Aldbury", "Fenwick Cross", "Marlow Park")
_TEXT_SUFFIXES = (".txt", ".txt.gz")
_TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DiskDocuments(Sequence[str]):
    """Documents left on disk, each read by `read(key)` when indexed. Built by one pass over (key, text) pairs, one
    text in memory at a time, that appends the keys of the non-blank texts to `keys` (empty: a list, or an array of
    row numbers) and notes their lengths and the corpus hash."""

    def __init__(self, texts: Iterable[tuple[Any, object]], keys: MutableSequence[Any], read: Callable[[Any], str]):
        self._keys, self._read = keys, read
        self.lengths = array("q")
        digest = hashlib.sha256()
        for key, text in texts:
            if isinstance(text, str) and text.strip():
                keys.append(key)
                self.lengths.append(len(text))
                digest.update(_document_digest(text))
        self.sha256 = digest.hexdigest()

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: int) -> str:
        return self._read(self._keys[index])


@dataclasses.dataclass(frozen=True)
class Corpus:
    name: str
    documents: Sequence[str]  # a tuple in memory, or DiskDocuments read one at a time

    @functools.cached_property
    def sha256(self) -> str:
        """sha256 over the sha256 digests of the documents' UTF-8 bytes, in order (artifacts record it: keep it)."""
        if isinstance(self.documents, DiskDocuments):
            return self.documents.sha256
        digest = hashlib.sha256()
        for document in self.documents:
            digest.update(_document_digest(document))
        return digest.hexdigest()

    @functools.cached_property
    def lengths(self) -> Sequence[int]:
        """Each document's length in characters, known without reading documents on disk again."""
        if isinstance(self.documents, DiskDocuments):
            return self.documents.lengths
        return [len(document) for document in self.documents]


def load_corpus(source: str | Path | None = None) -> Corpus:
    """Load a corpus; `None` or 'austen' is the shipped default, 'austen-repeats' the same with repeating documents
    (`repeating_documents`), 'austen-facts' those with facts inside the novels' text (`with_inserted_facts`),
    'austen-records' the same with facts in runs of one template, 'mixed' austen-repeats and the shipped code,
    documentation and math text (KVzap-style diversity), 'moby-dick' the shipped held-out book."""
    if source is None or str(source) in BOOK_CORPORA:
        books = _text_files("austen", sorted((shipped_folder("calibration_data") / "books").glob("austen_*.txt.gz")))
        if source is None or str(source) == DEFAULT_CORPUS:
            return books
        repeating = (*books.documents, *repeating_documents(books.documents))
        if str(source) == REPEATING_CORPUS:
            return Corpus(REPEATING_CORPUS, repeating)
        if str(source) in (FACTS_CORPUS, RECORDS_CORPUS):
            run = RECORD_RUN if str(source) == RECORDS_CORPUS else 1
            with_facts = [with_inserted_facts(book, seed, run=run) for seed, book in enumerate(books.documents)]
            return Corpus(str(source), (*with_facts, *repeating[len(books.documents) :]))
        mixed = _text_files(MIXED_CORPUS, sorted((shipped_folder("calibration_data") / "mixed").glob("*.txt.gz")))
        return Corpus(MIXED_CORPUS, (*repeating, *mixed.documents))
    if str(source) == HELD_OUT_CORPUS:
        return _text_files(
            HELD_OUT_CORPUS, sorted((shipped_folder("calibration_data") / "books").glob("melville_*.txt.gz"))
        )
    path = Path(source)
    if not path.exists():
        raise KVRuntimeError(f"corpus {path} does not exist (give a text file, a folder of .txt, or a jsonl/parquet)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.name.endswith(_TEXT_SUFFIXES))
        if not files:
            raise KVRuntimeError(f"corpus folder {path} holds no .txt or .txt.gz files")
        return _text_files(str(path), files)
    if path.name.endswith(_TEXT_SUFFIXES):
        return _text_files(str(path), [path])
    if path.suffix in _TABLE_SUFFIXES:
        return _table(path)
    raise KVRuntimeError(f"corpus {path}: unknown format (use .txt, .txt.gz, a folder, .jsonl, .parquet or .csv)")


def repeating_documents(
    books: Sequence[str], documents: int = 2, characters: int = 600_000, seed: int = 0
) -> list[str]:
    """Documents in which text repeats, built from `books`: blocks of one sentence (40-160 characters) said 10-60
    times, each followed by a paragraph of over 300 characters. Long contexts repeat (filler, boilerplate, logs) and a
    second pass spreads its attention over the copies, so a scorer distilled from it must see repetition in its
    calibration text; novels almost never repeat a sentence."""
    rng = random.Random(seed)
    sentences, paragraphs = [], []
    for book in books:
        sentences += [s for s in re.split(r"(?<=[.!?])\s+", " ".join(book.split())) if 40 <= len(s) <= 160]
        paragraphs += [" ".join(p.split()) for p in re.split(r"\n\s*\n", book) if len(p) > 300]
    made = []
    for _ in range(documents):
        blocks, size = [], 0
        while size < characters:
            blocks += [" ".join([rng.choice(sentences)] * rng.randint(10, 60)), rng.choice(paragraphs)]
            size += len(blocks[-2]) + len(blocks[-1]) + 4
        made.append("\n\n".join(blocks))
    return made


def with_inserted_facts(text: str, seed: int, every: int = 2_000, run: int = 1) -> str:
    """`text` with a fact sentence (`FACT_TEMPLATES`: seeded figures, names, codes) after the first sentence end past
    every `every` characters: a 2k-token passage holds about four, inside running text, as a prompt's facts are.
    `run` facts in a row share one template (a list of records: alike sentences, their values apart)."""
    rng = random.Random(f"facts:{seed}")
    pieces, start, template = [], 0, ""
    for count in itertools.count():
        end = text.find(". ", start + every)
        if end < 0:
            break
        template = rng.choice(FACT_TEMPLATES) if count % run == 0 else template
        fact = template.format(
            name=rng.choice(FACT_NAMES),
            place=rng.choice(FACT_PLACES),
            number=rng.randint(10_000, 9_999_999),
            small=rng.randint(2, 99),
            tiny=rng.randint(1, 19),
            year=rng.randint(1700, 1815),
            code=f"{rng.choice('ABCDEFGHKLMNPRSTWXZ')}{rng.choice('ABCDEFGHKLMNPRSTWXZ')}-{rng.randint(100, 9999)}",
        )
        pieces += [text[start : end + 2], fact, " "]
        start = end + 2
    return "".join([*pieces, text[start:]])


def passage_ids(tokenizer: PreTrainedTokenizerBase, document: str, start: int, tokens: int) -> list[int]:
    """The first `tokens` token ids of the document from character `start` (8 characters a token is ample)."""
    return tokenizer(document[start : start + tokens * 8], add_special_tokens=False).input_ids[:tokens]


def _document_digest(document: str) -> bytes:
    return hashlib.sha256(document.encode()).digest()


def _read_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    if b"\x00" in raw:
        raise KVRuntimeError(f"corpus file {path} is binary, not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVRuntimeError(f"corpus file {path} is not UTF-8 text (byte {exc.start})") from None


def _text_files(name: str, files: list[Path]) -> Corpus:
    documents = DiskDocuments(((path, _read_text(path)) for path in files), [], _read_text)
    if not documents:
        raise KVRuntimeError(f"corpus {name} is empty")
    return Corpus(name=name, documents=documents)


def _table(path: Path) -> Corpus:
    import datasets  # compile-stage dependency, imported only for table formats

    bars = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # a refusal stays one line; the conversion takes seconds at most
    try:
        # Converted once into Arrow files in the datasets cache, then memory-mapped (never copied into memory,
        # whatever datasets' settings say): rows are read when indexed.
        table = datasets.load_dataset(
            _TABLE_SUFFIXES[path.suffix], data_files=str(path), split="train", keep_in_memory=False
        )
    except Exception as exc:  # datasets raises many types for malformed files
        raise KVRuntimeError(f"corpus {path} cannot be read ({first_line(exc)})") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if "text" not in table.column_names:
        raise KVRuntimeError(f"corpus {path} has no 'text' column (columns: {', '.join(table.column_names)})")
    kind = getattr(table.features["text"], "dtype", "")
    if kind not in ("string", "large_string"):
        raise KVRuntimeError(f"corpus {path}: column 'text' holds {kind or 'nested'} values, not text")
    table = table.select_columns(["text"])
    documents = DiskDocuments(enumerate(_column_texts(table)), array("q"), functools.partial(_row_text, table))
    if not documents:
        raise KVRuntimeError(f"corpus {path} is empty")
    return Corpus(name=str(path), documents=documents)


def _column_texts(table: datasets.Dataset) -> Iterator[object]:
    """The text column in row order, one record batch at a time, read from the Arrow cache files rather than through
    the memory map: mapped pages, once read, would count in the process's resident memory until the kernel needs
    them back."""
    import pyarrow

    for cache_file in table.cache_files:
        with pyarrow.OSFile(cache_file["filename"]) as handle:
            for batch in pyarrow.ipc.open_stream(handle):
                yield from batch.column("text").to_pylist()


def _row_text(table: datasets.Dataset, row: int) -> str:
    return table[row]["text"]


def calibration_prompts(
    corpus: Corpus, tokenizer: PreTrainedTokenizerBase, count: int, tokens: int, seed: int
) -> list[tuple[int, torch.Tensor]]:
    """`count` prompts of `tokens` tokens (the tokenizer's opening ids first, `opening_ids`), taken round-robin from
    the documents at seeded offsets: (source, ids)."""
    import torch

    from kvcompile.prompt_format import opening_ids

    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        source = index % len(corpus.documents)
        document = corpus.documents[source]
        if len(document) < tokens * 8:
            raise KVRuntimeError(f"corpus {corpus.name}: document {source} is too short for {tokens}-token prompts")
        start = rng.randrange(0, len(document) - tokens * 8)
        opening = opening_ids(tokenizer)  # a whole prompt: Gemma's <bos> first
        ids = opening + passage_ids(tokenizer, document, start, tokens - len(opening))
        if len(ids) < tokens:
            raise KVRuntimeError(
                f"corpus {corpus.name}: document {source} gave a passage of {len(ids)} < {tokens} tokens"
            )
        prompts.append((source, torch.tensor([ids])))
    return prompts
