"""How an answer is scored against its expected values: substring matches (RULER's, and the built-in suite's
all-or-nothing), and SQuAD's (LongBench's) exact match and token F1 after normalising both texts. Every score is in
[0, 1]; a record's `correct` is that score."""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

SCORINGS = {
    # All-or-nothing, stricter than RULER's string_match_all (`fraction`): a multi-key answer with one key missing is
    # wrong, as the built-in suite has always scored it.
    "all": "1 when every expected value appears in the answer, else 0 (the built-in suite's)",
    "fraction": "the fraction of the expected values that appear in the answer (RULER's string_match_all)",
    "substring": "one of the expected answers appears in the answer (RULER's string_match_part)",
    "exact": "the normalised answer (its first line) equals one of the normalised expected answers (SQuAD's exact match)",
    "f1": "the best token F1 of the normalised answer (its first line) against an expected one (SQuAD, LongBench)",
}
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalized_words(text: str) -> list[str]:
    """SQuAD's normalisation: lower case, punctuation and the articles a/an/the removed, split on whitespace."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def token_f1(answer: str, expected: str) -> float:
    """F1 of the normalised words of `answer` against those of `expected` (1 when both are empty)."""
    said, wanted = normalized_words(answer), normalized_words(expected)
    if not said or not wanted:
        return float(said == wanted)
    common = sum((collections.Counter(said) & collections.Counter(wanted)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(said), common / len(wanted)
    return 2 * precision * recall / (precision + recall)


def first_line(text: str) -> str:
    """The first line of `text` that holds anything but whitespace ('' if none)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def score_answer(answer: str, expected: Sequence[str], scoring: str) -> float:
    """The score of a generated `answer` against the `expected` values under `scoring` (one of SCORINGS)."""
    if scoring in ("all", "fraction", "substring"):  # RULER's matches: which expected values the answer holds
        found = [value.lower() in answer.lower() for value in expected]
        if scoring == "fraction":
            return sum(found) / len(found)
        return float(all(found) if scoring == "all" else any(found))
    said = first_line(answer)  # a model goes on after its answer; SQuAD's scores read the answer alone
    if scoring == "exact":
        return float(any(normalized_words(said) == normalized_words(value) for value in expected))
    if scoring == "f1":
        return max(token_f1(said, value) for value in expected)
    raise ValueError(f"unknown scoring {scoring!r} (scorings: {', '.join(SCORINGS)})")
