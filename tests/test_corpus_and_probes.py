"""Calibration corpora and needle probes: loading, refusals, and that a needle is where it is said to be."""

import gzip
import json
import re

import pytest
from transformers import AutoTokenizer

from kvcompile.calibration.corpus import FACT_TEMPLATES, load_corpus, repeating_documents, with_inserted_facts
from kvcompile.tasks.needles import CALIBRATION_NEEDLES, answer_token_positions, needle_probe
from kvruntime.errors import KVRuntimeError
from kvruntime.models.model_loading import DEFAULT_MODEL, load_model

SENTENCES = " ".join(f"Sentence number {i} tells of the weather on day {i}." for i in range(4000))


@pytest.fixture(scope="module")
def tokenizer():
    # The default model's tokenizer (fast, with a chat template); loading the model once is cheap after caching.
    return load_model(DEFAULT_MODEL)[1]


def test_text_folder_gzip_and_tables_load(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("first document")
    (tmp_path / "docs" / "b.txt.gz").write_bytes(gzip.compress(b"second document"))
    assert list(load_corpus(tmp_path / "docs").documents) == ["first document", "second document"]
    lines = tmp_path / "c.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}) for t in ["one", "two", ""]))
    assert list(load_corpus(lines).documents) == ["one", "two"]


def test_repeating_documents_say_book_sentences_again_between_paragraphs_deterministically():
    paragraph = " ".join(f"Line {i} goes on." for i in range(30))  # sentences too short to repeat
    book = "\n\n".join(
        [
            f"Short one. The {w} sentence is of a fine middling length, as they go. {paragraph}"
            for w in ("first", "second", "third")
        ]
    )
    made = repeating_documents([book], documents=2, characters=5000, seed=3)
    assert made == repeating_documents([book], documents=2, characters=5000, seed=3) and made[0] != made[1]
    for document in made:
        assert len(document) >= 5000
        blocks = document.split("\n\n")
        for said, paragraph_after in zip(blocks[::2], blocks[1::2]):
            sentence = re.match(r"The \w+ sentence .*? go\.", said).group(0)
            assert 10 <= said.count(sentence) <= 60 and said == " ".join([sentence] * said.count(sentence))
            assert len(paragraph_after) > 300 and paragraph_after in " ".join(book.split())


def test_the_repeating_corpus_is_the_austen_novels_and_two_repeating_documents():
    books, repeating = load_corpus("austen"), load_corpus("austen-repeats")
    assert list(repeating.documents[: len(books.documents)]) == list(books.documents)
    assert len(repeating.documents) == len(books.documents) + 2 and repeating.sha256 != books.sha256


SENTENCE = r"Sentence number (\d+) tells of the weather on day \1\. ?"
FACT_PATTERNS = [re.compile(re.sub(r"\\\{\w+\\\}", r"[\\w .-]+?", re.escape(t)) + " ") for t in FACT_TEMPLATES]


def inserted_facts(made: str) -> list[str]:
    """What sits between the sentences of a text of `SENTENCE`s."""
    return [piece for piece in re.split(SENTENCE, made)[::2] if piece]


def test_facts_sit_after_a_sentence_end_every_so_often_and_take_nothing_from_the_text():
    text = " ".join(f"Sentence number {i} tells of the weather on day {i}." for i in range(400))  # 20k characters
    made = with_inserted_facts(text, seed=2, every=2_000)
    assert made == with_inserted_facts(text, seed=2, every=2_000) != with_inserted_facts(text, seed=3, every=2_000)
    facts = inserted_facts(made)
    assert 8 <= len(facts) <= 10  # one after the first sentence end past every 2,000 characters
    assert "".join(re.findall(SENTENCE.replace("(\\d+)", "\\d+").replace("\\1", "\\d+"), made)).strip() == text
    assert all(any(t.fullmatch(fact) for t in FACT_PATTERNS) and re.search(r"\d", fact) for fact in facts)


def test_facts_in_runs_share_one_template_per_run_and_differ_in_their_values():
    text = " ".join(f"Sentence number {i} tells of the weather on day {i}." for i in range(800))  # 40k characters
    facts = inserted_facts(with_inserted_facts(text, seed=5, every=2_000, run=4))
    used = [next(i for i, t in enumerate(FACT_PATTERNS) if t.fullmatch(fact)) for fact in facts]
    runs = [used[i : i + 4] for i in range(0, len(used), 4)]
    assert len(runs) >= 4 and all(len(set(run)) == 1 for run in runs) and len(set(used)) > 1
    assert len(set(facts)) == len(facts)  # one template, other values
    assert with_inserted_facts(text, seed=5, every=2_000, run=1) == with_inserted_facts(text, seed=5, every=2_000)


def test_the_facts_corpus_is_the_repeating_one_with_facts_in_the_novels_and_never_the_evaluations_wording():
    repeating, facts, records = (
        load_corpus("austen-repeats"),
        load_corpus("austen-facts"),
        load_corpus("austen-records"),
    )
    books = len(load_corpus("austen").documents)
    assert list(facts.documents[books:]) == list(repeating.documents[books:]) == list(records.documents[books:])
    assert all(len(f) > len(r) for f, r in zip(facts.documents[:books], repeating.documents[:books]))
    assert records.name == "austen-records" and records.sha256 != facts.sha256
    wording = " ".join(FACT_TEMPLATES).lower()
    assert not any(w in wording for w in ("pass key", "magic number", "remember it"))


def test_the_mixed_corpus_adds_code_documentation_and_math_and_never_the_evaluations_text():
    repeating, mixed = load_corpus("austen-repeats"), load_corpus("mixed")
    assert list(mixed.documents[: len(repeating.documents)]) == list(repeating.documents)
    added = mixed.documents[len(repeating.documents) :]
    assert len(added) == 24 and min(len(d) for d in added) >= 40_000  # enough for 2048-token prompts
    assert sum("def " in d for d in added) >= 8 and sum("Parameters" in d for d in added) >= 8
    moby = " ".join(load_corpus("moby-dick").documents[0].split())
    probes = [" ".join(moby[k * len(moby) // 50 :][:300].split()[2:10]) for k in range(50)]
    text = " ".join(" ".join(added).split())
    assert not any(p in text for p in probes) and "The grass is green" not in text


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: (p / "empty.txt").write_text("  \n") and p / "empty.txt", "is empty"),
        (lambda p: (p / "bin.txt").write_bytes(b"abc\x00def") and p / "bin.txt", "is binary"),
        (lambda p: (p / "latin.txt").write_bytes("caf\xe9".encode("latin-1")) and p / "latin.txt", "not UTF-8"),
        (lambda p: (p / "t.jsonl").write_text('{"body": "x"}') and p / "t.jsonl", "no 'text' column"),
        (lambda p: (p / "t.docx").write_text("x") and p / "t.docx", "unknown format"),
    ],
)
def test_bad_corpora_are_refused_with_a_clear_message(tmp_path, make, message):
    with pytest.raises(KVRuntimeError, match=message):
        load_corpus(make(tmp_path))


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9])
def test_needle_sits_at_the_stated_depth_and_the_answer_tokens_are_found(tmp_path, tokenizer, depth):
    (tmp_path / "book.txt").write_text(SENTENCES)
    corpus = load_corpus(tmp_path / "book.txt")
    probe = needle_probe(corpus, tokenizer, 1024, depth, needle_index=0, seed=0, chat=True)
    needle = CALIBRATION_NEEDLES[0]
    assert probe.prompt.count(needle.sentence) == 1
    assert probe.prompt[probe.answer_span[0] : probe.answer_span[1]] == needle.answer
    ids, span = answer_token_positions(tokenizer, probe)
    assert abs(len(ids) - 1024) < 40
    assert tokenizer.decode([ids[i] for i in span]).strip() == needle.answer
    # the needle starts right after a sentence end, at about `depth` of the haystack (one sentence is ~15 tokens)
    haystack_start = probe.prompt.index("Sentence number")
    haystack_end = probe.prompt.index("\n\nBased on the content")
    where = (probe.prompt.index(needle.sentence) - haystack_start) / (haystack_end - haystack_start)
    assert abs(where - depth) < 0.05
    assert probe.prompt.startswith("<|im_start|>system")


def test_raw_prompts_end_with_an_answer_cue(tmp_path, tokenizer):
    (tmp_path / "book.txt").write_text(SENTENCES)
    probe = needle_probe(load_corpus(tmp_path / "book.txt"), tokenizer, 512, 0.5, 1, seed=0, chat=False)
    assert probe.prompt.endswith("\nAnswer:") and "<|im_start|>" not in probe.prompt


def test_corpus_too_short_for_the_probe_is_refused(tmp_path, tokenizer):
    (tmp_path / "short.txt").write_text("Only a few words here. Nothing more.")
    with pytest.raises(KVRuntimeError, match="too short for"):
        needle_probe(load_corpus(tmp_path / "short.txt"), tokenizer, 1024, 0.5, 0, seed=0, chat=True)


def test_model_without_chat_template_is_refused(tmp_path, tokenizer):
    (tmp_path / "book.txt").write_text(SENTENCES)
    bare = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(KVRuntimeError, match="no chat template.*--prompt-format raw"):
        needle_probe(load_corpus(tmp_path / "book.txt"), bare, 512, 0.5, 0, seed=0, chat=True)
