"""Corpora read lazily: documents stay on disk until indexed, yet count, order, hash and probes are those of reading
everything into memory."""

import gzip
import hashlib
import json
import random

import pytest

from kvcompile.calibration.corpus import Corpus, load_corpus
from kvcompile.tasks.needles import needle_probe
from kvruntime.errors import KVRuntimeError

TEXTS = ["first document", "second document", "caf\u00e9 \u2014 na\u00efve"]
# The hash artifacts recorded before corpora were read lazily, for TEXTS: it must never change.
TEXTS_SHA256 = "7fd44859098870ef381b98731ce9b65f67839153e54e9436227fb55d7b889eed"


class ByteTokenizer:
    """One token per UTF-8 byte: enough for raw-text needle probes without a model."""

    def __call__(self, text: str, add_special_tokens: bool = False):
        return type("Encoding", (), {"input_ids": list(text.encode())})()

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


def eager_sha256(documents: list[str]) -> str:
    return hashlib.sha256(b"".join(hashlib.sha256(d.encode()).digest() for d in documents)).hexdigest()


def write_folder(folder, texts):
    """Files named so that sorting keeps the order of `texts`; every other one gzipped."""
    folder.mkdir()
    for index, text in enumerate(texts):
        if index % 2:
            (folder / f"{index:03}.txt.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (folder / f"{index:03}.txt").write_text(text, encoding="utf-8")
    return folder


def test_the_hash_is_the_one_artifacts_recorded(tmp_path):
    assert Corpus("memory", tuple(TEXTS)).sha256 == TEXTS_SHA256 == eager_sha256(TEXTS)
    assert load_corpus(write_folder(tmp_path / "docs", TEXTS)).sha256 == TEXTS_SHA256
    lines = tmp_path / "docs.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS), encoding="utf-8")
    assert load_corpus(lines).sha256 == TEXTS_SHA256


def test_a_folder_is_read_when_indexed(tmp_path):
    folder = write_folder(tmp_path / "docs", TEXTS)
    corpus = load_corpus(folder)
    (folder / "000.txt").write_text("rewritten after loading")
    assert corpus.documents[0] == "rewritten after loading"
    assert corpus.sha256 == TEXTS_SHA256  # hashed by the loading pass


def test_blank_documents_and_rows_are_skipped_in_order(tmp_path):
    texts = [f"document {i} " * (i + 1) if i % 3 else " \n\t" for i in range(10)]
    kept = [t for t in texts if t.strip()]
    corpus = load_corpus(write_folder(tmp_path / "docs", texts))
    assert len(corpus.documents) == len(kept) and list(corpus.documents) == kept
    assert corpus.documents[-1] == kept[-1] and list(corpus.lengths) == [len(t) for t in kept]
    assert corpus.sha256 == eager_sha256(kept)


def test_a_table_is_read_by_row_across_record_batches(tmp_path):
    # 2,500 rows span several Arrow record batches; empty, missing and non-string texts are skipped.
    rows = [{"text": f"row {i} " * (i % 5 + 1)} for i in range(2500)]
    for i in range(0, 2500, 7):
        rows[i] = {"text": random.Random(i).choice(["", "   ", None])}
    kept = [r["text"] for r in rows if r["text"] and r["text"].strip()]
    lines = tmp_path / "rows.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in rows))
    corpus = load_corpus(lines)
    assert len(corpus.documents) == len(kept)
    assert [corpus.documents[i] for i in (0, 1, 999, 1000, 2000, -1)] == [kept[i] for i in (0, 1, 999, 1000, 2000, -1)]
    assert list(corpus.documents) == kept and corpus.sha256 == eager_sha256(kept)


@pytest.mark.parametrize(
    "texts, message",
    [
        ([" ", "\n"], "is empty"),
        (["good text", b"bad\x00bytes"], "is binary"),
        (["good text", "caf\xe9".encode("latin-1")], "not UTF-8"),
    ],
)
def test_a_bad_file_anywhere_in_a_folder_is_refused_at_loading(tmp_path, texts, message):
    (tmp_path / "docs").mkdir()
    for index, text in enumerate(texts):
        path = tmp_path / "docs" / f"{index}.txt"
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(KVRuntimeError, match=message):
        load_corpus(tmp_path / "docs")


def test_needle_probes_are_those_of_the_documents_in_memory(tmp_path):
    # Books of growing length, a blank file among them: probe lengths leave one to all of them long enough.
    texts = ["".join(f"Paragraph {i} of book {b}. It rained.\n\n" for i in range(60 * b + 5)) for b in range(6)]
    texts.insert(2, "\n")
    lazy = load_corpus(write_folder(tmp_path / "docs", texts))
    eager = Corpus(lazy.name, tuple(t for t in texts if t.strip()))
    for length, seed in [(64, 0), (400, 1), (400, 2), (1500, 3)]:
        assert needle_probe(lazy, ByteTokenizer(), length, 0.5, 0, seed, chat=False) == needle_probe(
            eager, ByteTokenizer(), length, 0.5, 0, seed, chat=False
        )
