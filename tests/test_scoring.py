"""How answers are scored (`kvcompile.tasks.scoring`), against SQuAD's and RULER's definitions worked by hand."""

from __future__ import annotations

import pytest

from kvcompile.tasks.scoring import normalized_words, score_answer, token_f1


def test_token_f1_and_exact_match_follow_squad_worked_by_hand():
    # "the cat sat" -> ["cat", "sat"] (article dropped); "a cat sat down." -> ["cat", "sat", "down"]
    assert normalized_words("The Cat, sat!") == ["cat", "sat"]
    # common 2: precision 2/3, recall 2/2 -> F1 = 2 * (2/3) * 1 / (2/3 + 1) = 0.8
    assert token_f1("a cat sat down.", "the cat sat") == pytest.approx(0.8)
    assert token_f1("dog", "cat") == 0.0 and token_f1("", "") == 1.0
    # The best of the expected answers; the answer's first line only (a model goes on after it).
    assert score_answer("\n Thunder Moon.\nThen it ran away", ("grey horse", "thunder moon"), "exact") == 1.0
    assert score_answer("Thunder Moon was its name", ("thunder moon",), "exact") == 0.0
    assert score_answer("red kite\nred kite and more", ("a red kite", "kite"), "f1") == pytest.approx(1.0)
    assert score_answer("It is in Lyon", ("Paris", "lyon"), "substring") == 1.0
    assert score_answer("It is in Lyon", ("Paris", "lyon"), "all") == 0.0


def test_token_f1_counts_repeated_words_and_normalises_as_squad_does():
    # SQuAD's F1 counts words as a multiset: "cat cat" against "cat" has 1 word in common, precision 1/2, recall 1.
    assert token_f1("cat cat", "cat") == pytest.approx(2 / 3)
    assert token_f1("cat", "cat cat") == pytest.approx(2 / 3)
    # Only repeats on both sides tell a multiset from a set: "cat cat" against itself is 1 (a set: 1 common word of
    # 2 said and 2 wanted, 1/2); "cat cat dog" against "cat cat": 2 common, precision 2/3, recall 1, F1 0.8 (a set:
    # 1 common, 1/3 and 1/2, F1 0.4).
    assert token_f1("cat cat", "cat cat") == 1.0
    assert token_f1("cat cat dog", "cat cat") == pytest.approx(0.8)
    # Punctuation goes before the articles: "the-cat" is one word, "thecat", with no article left to remove.
    assert normalized_words("the-cat") == ["thecat"] and normalized_words("The cat-") == ["cat"]
    assert token_f1("the-cat", "cat") == 0.0
    # An article inside a word stays: only whole words a, an, the go.
    assert normalized_words("Theater an anthem a") == ["theater", "anthem"]


def test_all_is_all_or_nothing_and_fraction_is_rulers_string_match_all():
    # RULER's string_match_all: the mean over references of whether each is in the prediction (lower case).
    keys = ("4417", "Lyon", "kite")
    assert score_answer("the keys: 4417 and lyon", keys, "fraction") == pytest.approx(2 / 3)
    assert score_answer("the keys: 4417 and lyon", keys, "all") == 0.0
    assert score_answer("4417, LYON, kite", keys, "all") == score_answer("4417, LYON, kite", keys, "fraction") == 1.0
    assert score_answer("nothing", keys, "fraction") == 0.0
    with pytest.raises(ValueError, match="unknown scoring"):
        score_answer("x", ("x",), "bleu")
