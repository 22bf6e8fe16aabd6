"""A GGUF's SentencePiece tokenizer (Gemma's) built by kvruntime, as it builds SmolLM2's byte-level one: no
transformers converter, so every transformers version gets the same tokenizer (5.2's renamed a byte token)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import generate_merges

from kvruntime.models.gguf_tokenizer import (
    GGUFTokenizer,
    build_tokenizer,
    sentencepiece_merges,
    sentencepiece_spelling,
    tokenizer_problems,
    tokenizer_reference,
)

# A SentencePiece vocabulary as a GGUF stores it (Gemma's: runs of spaces as spaces, byte tokens, user-defined runs
# of newlines), its merge order the file's.
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<0x09>", "<0x0A>", "\u2581", "a", "b", "c", "ab", "bc", "abc",
          "\u2581a", "\u2581ab", "\u2581abc", "  ", "   ", "ca", "\n", "\n\n", "cab", "b\u2581", "[mm]"]  # fmt: skip
TYPES = [3, 3, 3, 2, 6, 6] + [1] * 13 + [4, 4] + [1, 1, 4]


def _spec(add_bos: bool = True) -> GGUFTokenizer:
    return GGUFTokenizer(
        model="llama", pre="default", tokens=tuple(TOKENS), token_types=tuple(TYPES), merges=(), bos_id=2, eos_id=1,
        unk_id=3, pad_id=0, add_bos=add_bos, add_space_prefix=False, chat_template=None,
    )  # fmt: skip


def test_the_merges_a_sentencepiece_vocabulary_implies_are_transformers_own():
    """transformers' `generate_merges` (what its GGUF converter runs, with the file's order as the score) is the
    independent reference; a set would not do: the order is the merge priority."""
    spelled = sentencepiece_spelling(TOKENS)
    vocab = {token: index for index, token in enumerate(spelled)}
    expected = generate_merges(vocab, {token: -index for index, token in enumerate(spelled)})
    assert sentencepiece_merges(spelled) == expected
    assert ("a", "b") in expected and expected.index(("a", "b")) < expected.index(("ab", "c"))


def test_runs_of_spaces_are_spelled_with_the_space_mark():
    assert sentencepiece_spelling(["  ", "   ", "\u2581", "a b", " "]) == ["\u2581\u2581", "\u2581\u2581\u2581", "\u2581",
                                                                         "a b", "\u2581"]  # fmt: skip


@pytest.mark.parametrize(
    "text, ids",
    [
        ("abc", [12]),  # a whole token
        ("ab abc", [10, 15]),  # a space becomes the mark, which starts the next piece
        ("cab", [21]),
        ("c\tb", [9, 4, 8]),  # a tab: no token, so its byte token (byte fallback)
        ("a  b", [7, 16, 8]),  # two spaces: Gemma's token of two spaces, spelled with marks
        ("a\n\nb", [7, 20, 8]),  # a user-defined run of newlines, matched whole
        ("a[mm]b", [7, 23, 8]),  # a user-defined token no merge makes (Gemma's `[multimodal]`), matched whole
        ("\u00e9", [3]),  # no byte token for its bytes here: unknown (Gemma has all 256)
    ],
)
def test_a_built_sentencepiece_tokenizer_encodes_as_worked_out_by_hand(text, ids):
    tokenizer = build_tokenizer(_spec(add_bos=False))
    assert tokenizer.encode(text).ids == ids


def test_the_built_tokenizer_opens_with_bos_and_passes_the_caches_check():
    spec = _spec()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(spec), bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        pad_token="<pad>",
    )  # fmt: skip
    assert fast("ab abc").input_ids == [2, 10, 15]
    assert fast.decode([10, 15, 4, 16, 20]) == "ab abc\t  \n\n"
    problems = tokenizer_problems(fast, tokenizer_reference(spec))
    # The tiny vocabulary cannot spell the check's probe text; everything else about it holds.
    assert problems and all("survive" in problem or "special" in problem for problem in problems)
