"""CompressKV's pure functions: Algorithm 1 budgets, SRH and classic retrieval scores, answer recall."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile.recipes.compresskv.head_comparison import compare_heads
from kvcompile.recipes.compresskv.head_scores import copy_retrieval_score, rouge1_recall, semantic_retrieval_score
from kvcompile.recipes.compresskv.layer_errors import normalised_layer_error
from kvruntime.math.allocation import error_aware_budgets


def test_uniform_errors_give_uniform_budgets():
    assert error_aware_budgets([1.0] * 4, 100) == [100, 100, 100, 100]


def test_budgets_follow_the_error_and_respect_the_bounds():
    budgets = error_aware_budgets([0.0, 0.1, 0.2, 0.7], 100)
    assert sum(budgets) == 400
    assert budgets[0] == 32  # the minimum
    assert budgets[1] < budgets[2] < budgets[3]
    # one layer holds all the error: 32 + 272 is clipped at 3 x 100; the 4 left over go to the next in line
    assert error_aware_budgets([0.0, 0.0, 0.0, 1.0], 100) == [36, 32, 32, 300]
    # A 150-token context caps the last layer at 150; what it cannot use goes to the others, in error order (ties by
    # index), so the total stays 4 x 100 (a ratio is held).
    assert error_aware_budgets([0.0, 0.0, 0.0, 1.0], 100, length=150) == [150, 68, 32, 150]


def test_hand_computed_allocation():
    # total 4 x 64 = 256; free = 256 - 4 x 32 = 128; 32 + round(e * 128) = [32+13, 32+26, 32+38, 32+51] = [45, 58, 70, 83]
    # that sums to 256 exactly.
    assert error_aware_budgets([0.1, 0.2, 0.3, 0.4], 64) == [45, 58, 70, 83]


def test_rounding_is_repaired_towards_the_highest_error():
    budgets = error_aware_budgets([1, 1, 1], 40)  # 32 + round(1/3 * 24) = 40 each: already exact
    assert budgets == [40, 40, 40]
    budgets = error_aware_budgets([1, 1, 2], 41)  # 32 + round([7.75, 7.75, 15.5]) = [40, 40, 48] -> 128 > 123
    assert sum(budgets) == 123 and budgets[2] == max(budgets)


@given(
    st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=1, max_size=40).filter(lambda e: sum(e) > 1e-6),
    st.integers(min_value=1, max_value=4096),
)
@settings(max_examples=200, deadline=None)
def test_budgets_always_sum_to_the_total_within_bounds(errors, budget):
    budgets = error_aware_budgets(errors, budget)
    assert sum(budgets) == budget * len(errors)
    assert all(min(32, budget) <= b <= 3 * budget for b in budgets)


def test_bad_errors_are_refused():
    for bad in ([], [0.0, 0.0], [1.0, -1.0]):
        with pytest.raises(ValueError):
            error_aware_budgets(bad, 64)


def test_layer_error_profile_normalises_each_source_first():
    per_source = torch.tensor([[1.0, 1.0], [0.0, 100.0]], dtype=torch.float64)
    # source profiles [0.5, 0.5] and [0, 1] -> mean [0.25, 0.75]: the large raw sums of source 2 do not dominate
    torch.testing.assert_close(normalised_layer_error(per_source), torch.tensor([0.25, 0.75], dtype=torch.float64))


def test_rouge1_recall():
    assert rouge1_recall("the Silver Heron", "She named it The Silver Heron.") == 1.0
    assert rouge1_recall("smoked paprika with honey", "paprika") == 0.25
    assert rouge1_recall("", "anything") == 0.0


PROMPT = [10, 11, 12, 13, 14, 15]  # tokens; the answer span is positions 2..4 (tokens 12 13 14)
SPAN = [2, 3, 4]


def _attention(rows):
    """rows: per step, a [prompt] attention row for a single layer and head -> [steps, 1, 1, prompt]."""
    return torch.tensor(rows, dtype=torch.float64)[:, None, None, :]


def test_srh_score_counts_whole_span_mass_on_steps_that_produce_span_tokens():
    attention = _attention([[0.1, 0.1, 0.3, 0.2, 0.1, 0.2], [0.5, 0.0, 0.0, 0.0, 0.5, 0.0], [0.0] * 5 + [1.0]])
    generated = [13, 14, 99]  # steps 0 and 1 produce span tokens, step 2 does not
    score = semantic_retrieval_score(attention, PROMPT, SPAN, generated)
    assert score.shape == (1, 1)
    assert score.item() == pytest.approx(0.6 + 0.5)


def test_classic_score_needs_top_attention_on_the_copied_token():
    attention = _attention([[0.0, 0.0, 0.1, 0.8, 0.1, 0.0], [0.0, 0.0, 0.9, 0.0, 0.1, 0.0]])
    # step 0 copies token 13 from position 3 (its top key): counts; step 1 generates 14 but looks at 12: does not
    score = copy_retrieval_score(attention, PROMPT, SPAN, [13, 14])
    assert score.item() == pytest.approx(1 / 3)


def test_head_comparison_finds_heads_only_srh_ranks_on_top():
    srh = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    classic = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    result = compare_heads(srh, classic, top_k=2)
    assert result.layers_with_different_top == 1
    assert result.srh_only == [(1, 2), (1, 3)]
