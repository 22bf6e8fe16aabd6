"""benchmarks/distilled/join_runs: a contestant's records take the bar run's prompt numbers by (task, length, depth),
and prompts that are not the same are refused."""

import pytest

from benchmarks.distilled.join_runs import joined


def record(method: str, task: str, depth: float, prompt: int, answer: str = "42", ratio: float = 0.5) -> dict:
    return {
        "method": method,
        "task": task,
        "length": 2048,
        "depth": depth,
        "prompt": prompt,
        "answer": answer,
        "ratio": ratio,
    }


BAR = [
    record("full", "needle", 0.1, 0),
    record("distilled", "needle", 0.1, 0),
    record("full", "docs_sentence", 0.1, 1, answer="def"),
    record("distilled", "docs_sentence", 0.1, 1),
    record("full", "docs_sentence", 0.9, 2, answer="ghi"),
]


def test_a_contestant_takes_the_bar_prompt_numbers_and_its_full_records_are_dropped():
    # the contestant ran the docs alone, so its prompts are numbered from 0
    contestant = [
        record("full", "docs_sentence", 0.9, 0, answer="ghi"),
        record("q8", "docs_sentence", 0.9, 0),
        record("full", "docs_sentence", 0.1, 1, answer="def"),
        record("q8", "docs_sentence", 0.1, 1),
    ]
    out = joined(BAR, contestant)
    assert out[: len(BAR)] == BAR
    assert [(r["method"], r["depth"], r["prompt"]) for r in out[len(BAR) :]] == [
        ("q8", 0.9, 2),
        ("q8", 0.1, 1),
    ]


def test_prompts_whose_full_answers_differ_are_refused():
    contestant = [record("full", "docs_sentence", 0.9, 0, answer="other"), record("q8", "docs_sentence", 0.9, 0)]
    with pytest.raises(SystemExit, match="full cache's answers differ"):
        joined(BAR, contestant)


def test_a_prompt_the_bar_run_lacks_is_refused():
    with pytest.raises(SystemExit, match="no prompt"):
        joined(BAR, [record("q8", "multikey", 0.5, 0)])
