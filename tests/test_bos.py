"""`<bos>` wherever a whole prompt is encoded (issue #78: Gemma without it degenerates, and SmolLM2's tokenizer adds
none, so only a tokenizer that adds one tells): generate with and without --question, the eval's contexts, the
compile stage's calibration prompts (what distill, heads and tables prefill) and the SRH probes' answer positions;
on the tests' character tokenizer (id = character code - 31) with a `<bos>` (96) and without, against ids worked out
by hand."""

from __future__ import annotations

import pytest
from test_shipped_models import bos_tokenizer

from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.cli.generation import encoded_prompts
from kvcompile.evaluation.runner import split_prompt
from kvcompile.tasks.needles import NeedleProbe, answer_token_positions
from kvcompile.tasks.retrieval import TaskPrompt

BOS = 96


def ids_of(text: str) -> list[int]:
    """The character tokenizer's ids: printable ASCII's code - 31, anything else 0 (its unknown token)."""
    return [ord(character) - 31 if " " <= character <= "~" else 0 for character in text]


KINDS = {"adds bos": [BOS], "asks for bos without adding it": [BOS], "no bos": []}


@pytest.fixture(params=list(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def opening(kind: str) -> list[int]:
    return KINDS[kind]


@pytest.fixture
def tokenizer(kind, tmp_path):
    """The character tokenizer: with a post-processor that puts `<bos>` first (Gemma's, as kvruntime builds it), with
    `add_bos_token` set but nothing that adds it (as some transformers versions converted Gemma's GGUF), or plain."""
    from conftest import save_char_tokenizer
    from transformers import AutoTokenizer

    if kind == "adds bos":
        return bos_tokenizer(tmp_path / "bos")
    save_char_tokenizer(tmp_path / "plain")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "plain")
    if kind == "asks for bos without adding it":
        tokenizer.add_special_tokens({"bos_token": "<bos>"})
        tokenizer.add_bos_token = True
        tokenizer.backend_tokenizer.post_processor = None
        assert tokenizer("ab").input_ids == ids_of("ab")  # it asks, and adds nothing
    return tokenizer


def test_generate_opens_the_prompt_with_bos_and_a_question_without(tokenizer, opening):
    ((_, row, asked),) = encoded_prompts(tokenizer, [("p", "The key is 7.")], None, False, 4, None)
    assert row.tolist() == [*opening, *ids_of("The key is 7.")] and asked == []
    ((_, row, asked),) = encoded_prompts(tokenizer, [("p", "The key is 7.")], ["Key?", "Why?"], False, 4, None)
    assert row.tolist() == [*opening, *ids_of("The key is 7.")]  # the context: a whole prompt
    assert [ids.tolist() for ids in asked] == [ids_of("\nKey?"), ids_of("\nWhy?")]  # after it: no bos


def test_the_evals_context_opens_with_bos_and_its_question_does_not(tokenizer, opening):
    prompt = TaskPrompt("passkey", "Key 25. What?", ("25",), 13, None, question_start=7)
    context, question = split_prompt(tokenizer, prompt, question_aware=False)
    assert context.tolist() == [[*opening, *ids_of("Key 25.")]]
    assert question.tolist() == [ids_of(" What?")]
    context, question = split_prompt(tokenizer, prompt, question_aware=True)
    assert context.tolist() == [[*opening, *ids_of("Key 25. What")]] and question.tolist() == [ids_of("?")]


def test_calibration_prompts_open_with_bos_once(tokenizer, opening):
    corpus = Corpus("letters", ("".join(chr(97 + (j * 7) % 26) for j in range(3000)),))
    ((_, ids),) = calibration_prompts(corpus, tokenizer, 1, 64, 0)
    assert ids.shape == (1, 64) and ids[0, : len(opening)].tolist() == opening
    assert int((ids == BOS).sum()) == len(opening)


def test_srh_probe_answer_positions_point_at_the_answer_after_bos(tokenizer, opening):
    probe = NeedleProbe("Say: 25613 ok", "25613", (5, 10), 13, 0.5, 0)
    ids, positions = answer_token_positions(tokenizer, probe)
    assert ids == [*opening, *ids_of("Say: 25613 ok")]
    assert positions == [len(opening) + 5 + i for i in range(5)]
    assert [ids[position] for position in positions] == ids_of("25613")
