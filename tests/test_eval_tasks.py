"""The evaluation suite's prompt generators, with the default model's tokenizer: each fact is really in the
context at the stated depth, the expected answers are those inserted, lengths are as asked, and the haystacks and
needles are not the calibration ones."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvcompile.calibration.corpus import load_corpus
from kvcompile.tasks.grid import SUITE_TASKS, WITHOUT_DEPTH, parse_lengths, sample_depth
from kvcompile.tasks.needles import CALIBRATION_NEEDLES
from kvcompile.tasks.passkey import FILLER, INTRO
from kvcompile.tasks.qa import MOBY_DICK_QUESTIONS
from kvcompile.tasks.real_text import HELD_OUT_FILES, REAL_TEXT_TASKS, held_out_text
from kvcompile.tasks.suite import suite_prompts
from kvruntime.errors import KVRuntimeError

LENGTHS = [1024, 2048]
SAMPLES = 3


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return suite_prompts(load_corpus("moby-dick"), tokenizer, SUITE_TASKS, LENGTHS, SAMPLES, seed=0)


def of(prompts, task):
    chosen = [p for p in prompts if p.task == task]
    assert len(chosen) == len(LENGTHS) * SAMPLES
    return chosen


def context(prompt) -> str:
    return prompt.prompt[: prompt.question_start]


def relative_position(prompt, text: str) -> float:
    """Where `text` starts in the context, as a share of the context (the chat template's few lines included)."""
    body = context(prompt)
    assert body.count(text) == 1, f"{text!r} occurs {body.count(text)} times in the {prompt.task} context"
    return body.index(text) / len(body)


@pytest.mark.integration  # the default model's tokenizer
def test_every_prompt_has_the_asked_length_and_a_question_after_its_context(prompts, tokenizer):
    for prompt in prompts:
        tokens = len(tokenizer(prompt.prompt, add_special_tokens=False).input_ids)
        assert abs(tokens - prompt.length) <= 0.06 * prompt.length, (prompt.task, prompt.length, tokens)
        question = prompt.prompt[prompt.question_start :]
        assert "?" in question or "Question" in question or "Continue the text above" in question
        assert prompt.score(" ".join(prompt.expected)) and not prompt.score("")


def first_fact(prompt) -> str:
    """The words of the fact placed at the prompt's depth."""
    value = prompt.expected[0]
    if prompt.task == "qa":
        return next(q.evidence for q in MOBY_DICK_QUESTIONS if q.answer == value)
    return {
        "passkey": f"The pass key is {value}",
        "passkey_prose": f"The pass key is {value}",
        "needle": value,
        "needle_filler": value,
        "multikey": f"is: {value}.",
        "multikey_filler": f"is: {value}.",
        "multivalue": f"is: {value}.",
        "variable_tracking": f"VAR {value} =",
    }[prompt.task]


@pytest.mark.integration  # the default model's tokenizer
def test_facts_sit_at_the_stated_depth(prompts):
    for task in SUITE_TASKS:
        if task in WITHOUT_DEPTH or task in REAL_TEXT_TASKS:  # a real text's fact: the one nearest the depth
            continue
        for prompt in of(prompts, task):
            if task == "qa":  # the book's line breaks are spaces in the window
                body = " ".join(context(prompt).split())
                where = body.index(first_fact(prompt)) / len(body)
            else:
                where = relative_position(prompt, first_fact(prompt))
            # At the last sentence boundary before the depth: a long sentence of Moby-Dick can leave the pass key,
            # the shortest of the facts, a fifth of its context earlier.
            early = 0.2 if task == "passkey_prose" else 0.06
            assert prompt.depth - early <= where <= prompt.depth + 0.06, (task, prompt.length, prompt.depth, where)


@pytest.mark.integration  # the default model's tokenizer
def test_each_retrieval_task_comes_on_both_haystacks_with_the_same_facts(prompts):
    """A task and its twin differ in the haystack alone: the same values at the same depth, asked the same way, in
    Moby-Dick or in RULER's repeated filler."""
    for book, filler in (("passkey_prose", "passkey"), ("needle", "needle_filler"), ("multikey", "multikey_filler")):
        for on_book, on_filler in zip(of(prompts, book), of(prompts, filler), strict=True):
            assert (on_book.expected, on_book.depth) == (on_filler.expected, on_filler.depth)
            assert on_book.prompt[on_book.question_start :] == on_filler.prompt[on_filler.question_start :]
            assert context(on_filler).count(FILLER.split(". ")[1]) > 10
            assert FILLER.split(". ")[1] not in context(on_book)
    for prompt in of(prompts, "passkey_prose"):  # the pass key's own format: its introduction, its answer cue
        assert prompt.prompt.startswith(INTRO) and prompt.prompt.endswith("The pass key is")


def test_the_depths_of_a_task_cover_the_context():
    assert [sample_depth(i, 3) for i in range(3)] == [0.1, 0.5, 0.9]
    assert sample_depth(0, 1) == 0.5


@pytest.mark.integration  # the default model's tokenizer
def test_expected_answers_are_the_inserted_values(prompts):
    for prompt in [*of(prompts, "passkey"), *of(prompts, "passkey_prose")]:
        assert context(prompt).count(prompt.expected[0]) == 2  # "The pass key is K. ... K is the pass key."
    for prompt in [*of(prompts, "multikey"), *of(prompts, "multikey_filler")]:
        sentences = re.findall(r"special magic numbers for (\w+) is: (\d+)\.", context(prompt))
        assert len(sentences) == 4 and len({k for k, _ in sentences}) == 4
        asked = re.search(r"magic number for (\w+)\?", prompt.prompt[prompt.question_start :]).group(1)
        assert dict(sentences)[asked] == prompt.expected[0]
    for prompt in of(prompts, "multivalue"):
        sentences = re.findall(r"special magic numbers for (\w+) is: (\d+)\.", context(prompt))
        assert {k for k, _ in sentences} == {re.search(r"numbers for (\w+)\?", prompt.prompt).group(1)}
        assert sorted(v for _, v in sentences) == sorted(prompt.expected) and len(prompt.expected) == 4
    for prompt in of(prompts, "variable_tracking"):
        value = re.search(r"assigned the value (\d+)", prompt.prompt[prompt.question_start :]).group(1)
        chain = re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", context(prompt))
        holders, changed = {n for n, v in chain if v == value}, True
        while changed:
            before = len(holders)
            holders |= {n for n, v in chain if v.removeprefix("VAR ") in holders}
            changed = len(holders) > before
        assert holders == set(prompt.expected) and len(chain) == 3
    for prompt in of(prompts, "qa"):
        item = next(q for q in MOBY_DICK_QUESTIONS if q.answer == prompt.expected[0])
        assert item.question in prompt.prompt[prompt.question_start :]
        assert item.answer in item.evidence and item.evidence in " ".join(context(prompt).split())


@pytest.mark.integration  # the default model's tokenizer
def test_common_words_are_the_most_frequent_by_a_margin(prompts):
    for prompt in of(prompts, "common_words"):
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", context(prompt)))
        common = [w for w, _ in counts.most_common(len(prompt.expected))]
        assert set(common) == set(prompt.expected)
        rest = max(c for w, c in counts.items() if w not in prompt.expected)
        assert min(counts[w] for w in prompt.expected) >= 3 * rest


@pytest.mark.integration  # the default model's tokenizer
def test_haystacks_and_needles_are_not_the_calibration_ones(prompts):
    austen = " ".join(" ".join(load_corpus("austen").documents).split())
    moby = " ".join(load_corpus("moby-dick").documents[0].split())
    for prompt in prompts:
        body = context(prompt)
        assert not any(n.sentence in body for n in CALIBRATION_NEEDLES)
        if prompt.task in ("needle", "multikey", "multivalue", "qa"):
            samples = [" ".join(body[len(body) * k // 4 :][:400].split()[2:10]) for k in (1, 2, 3)]
            assert any(sample in moby for sample in samples), prompt.task  # (a sample may cross an inserted fact)
            assert not any(sample in austen for sample in samples)


@pytest.mark.integration  # the default model's tokenizer
def test_prompts_are_reproducible_and_seeds_change_them(tokenizer):
    book = load_corpus("moby-dick")
    again = suite_prompts(book, tokenizer, ["multikey", "variable_tracking"], [1024], 2, seed=0)
    assert again == suite_prompts(book, tokenizer, ["multikey", "variable_tracking"], [1024], 2, seed=0)
    other = suite_prompts(book, tokenizer, ["multikey", "variable_tracking"], [1024], 2, seed=1)
    assert all(a.expected != b.expected for a, b in zip(again, other))


@pytest.mark.integration  # the default model's tokenizer
def test_a_task_with_its_own_count_spreads_its_own_depths(tokenizer):
    book = load_corpus("moby-dick")
    prompts = suite_prompts(book, tokenizer, ["passkey", "needle"], [1024], {"passkey": 3, "needle": 1}, seed=0)
    assert [(p.task, p.depth) for p in prompts] == [
        ("passkey", 0.1),
        ("passkey", 0.5),
        ("passkey", 0.9),
        ("needle", 0.5),
    ]


def test_lengths_and_tasks_are_checked():
    assert parse_lengths("2k, 4k,1500") == [2048, 4096, 1500]
    with pytest.raises(KVRuntimeError, match="'2x' is not a length"):
        parse_lengths("2x")
    with pytest.raises(KVRuntimeError, match="at least 256 tokens"):
        parse_lengths("100")
    with pytest.raises(KVRuntimeError, match=r"unknown tasks \['ruler'\]"):
        suite_prompts(load_corpus("moby-dick"), None, ["ruler"], [1024], 1, 0)


@pytest.mark.integration  # the default model's tokenizer
def test_raw_prompts_for_base_models_carry_no_chat_markup(tokenizer):
    book = load_corpus("moby-dick")
    chat = suite_prompts(book, tokenizer, SUITE_TASKS, [1024], 1, seed=0, prompt_format="auto")
    raw = suite_prompts(book, tokenizer, SUITE_TASKS, [1024], 1, seed=0, prompt_format="raw")
    assert all("<|im_start|>" in p.prompt for p in chat if not p.task.startswith("passkey"))  # raw, with its cue
    for plain, templated in zip(raw, chat):
        assert "<|im_start|>" not in plain.prompt and plain.expected == templated.expected
        assert plain.prompt.rstrip().endswith(("Answer:", "they are:", "are:", "pass key is"))
    with pytest.raises(KVRuntimeError, match="--prompt-format 'xml'"):
        suite_prompts(book, tokenizer, ["qa"], [1024], 1, seed=0, prompt_format="xml")


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.integration  # the default model's tokenizer
def test_a_signature_question_asks_for_the_parameters_written_in_its_context(prompts):
    for prompt in of(prompts, "code_signature"):
        name = re.search(r"function `(\w+)`", prompt.prompt[prompt.question_start :]).group(1)
        found = re.findall(rf"def {name}\(([^()]*)\)", context(prompt))
        assert len(found) == 1 and flat(found[0]) == prompt.expected[0]
        assert set(p.strip().split("=")[0] for p in found[0].split(",")) - {"self", "cls", ""}


@pytest.mark.integration  # the default model's tokenizer
def test_a_sentence_question_quotes_the_opening_of_a_sentence_its_answer_ends(prompts):
    for task in ("docs_sentence", "jekyll_sentence"):
        for prompt in of(prompts, task):
            opening = re.search(r'begins "(.*)"\. How does it end', prompt.prompt[prompt.question_start :]).group(1)
            assert flat(context(prompt)).count(opening) == 1
            assert flat(context(prompt)).count(f"{opening} {prompt.expected[0]}") == 1
            assert len(prompt.expected[0].split()) >= 5 and prompt.expected[0][-1] in ".!?"


@pytest.mark.integration  # the default model's tokenizer
def test_a_continuation_expects_the_real_text_that_follows_its_context(prompts, tokenizer):
    for task in ("code_continuation", "docs_continuation", "jekyll_continuation"):
        texts = [flat(d) for d in held_out_text(task.split("_")[0]).documents]
        for prompt in of(prompts, task):
            tail, expected = flat(context(prompt)[-300:]), flat(prompt.expected[0])  # stripped: a space between?
            followed = sum(text.count(tail + expected) + text.count(f"{tail} {expected}") for text in texts)
            assert followed == sum(text.count(tail) for text in texts) >= 1, task  # the reference repeats topics
            assert 20 <= len(tokenizer(prompt.expected[0], add_special_tokens=False).input_ids) <= 60


def test_no_compile_corpus_holds_held_out_text():
    """The held-out texts are not in what the compile commands read (the novels, the repeating documents, the
    mixed code, documentation and math): 40 passages of each held-out document, none found there."""
    calibration = [flat(d) for d in load_corpus("mixed").documents]
    for kind in HELD_OUT_FILES:
        for document in held_out_text(kind).documents:
            text = flat(document)
            for start in range(0, len(text) - 120, len(text) // 40):
                assert not any(text[start : start + 120] in c for c in calibration), (kind, text[start : start + 120])
