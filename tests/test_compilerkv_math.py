"""CompilerKV's pure math: stabilized utility, risk signals and bins, the elastic and ratio-honest gates, table
lookups."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvruntime.errors import ArtifactError, KVRuntimeError
from kvruntime.methods.compilerkv.risk_gate import (
    candidate_count,
    gated_count,
    kept_counts,
    pooled_counts,
    quantile_edges,
    risk_bin,
    semantic_risk,
    structural_risk,
)
from kvruntime.methods.compilerkv.stabilized_utility import (
    global_attention_mass,
    head_weighted_scores,
    mean_window_attention,
    relative_value_norms,
)
from kvruntime.methods.compilerkv.tables import CompilerKVTables, interpolate_layers


def _attention(layers: int, kv_heads: int, groups: int, window: int, length: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(1, kv_heads, groups, window, length, generator=g).softmax(-1) for _ in range(layers)]


def test_alpha_is_the_specs_window_sum_of_the_all_layer_all_head_mean_scaled_by_n_over_w():
    attention = _attention(layers=3, kv_heads=2, groups=3, window=4, length=20, seed=0)
    alpha = global_attention_mass([mean_window_attention(a) for a in attention])[0]
    # Spec: Abar[j, t] = mean over all layers and heads; alpha[t] = (n / w) * sum_j Abar[j, t].
    per_head = torch.cat([a[0].reshape(6, 4, 20) for a in attention])  # [L * Hq, w, N]
    expected = (20 / 4) * per_head.mean(dim=0).sum(dim=0)
    torch.testing.assert_close(alpha, expected)
    assert float(alpha.mean()) == pytest.approx(1.0)


def test_relative_value_norms_average_one_per_layer_and_kv_head():
    values = torch.randn(1, 3, 50, 8) * torch.tensor([1.0, 10.0, 0.1]).view(1, 3, 1, 1)
    rho = relative_value_norms(values)
    torch.testing.assert_close(rho.mean(dim=-1), torch.ones(1, 3))
    torch.testing.assert_close(rho[0, 1], values[0, 1].norm(dim=-1) / values[0, 1].norm(dim=-1).mean())


def test_weighted_max_pooling_over_query_heads_follows_repeat_kv_grouping():
    alpha = torch.rand(1, 10)
    rho = torch.rand(1, 2, 10)
    weights = torch.tensor([0.8, 1.2, 1.0, 1.5])  # heads 0, 1 read KV head 0; heads 2, 3 read KV head 1
    scores = head_weighted_scores(alpha, rho, weights)
    expected = torch.stack([weights[h] / 1.5 * alpha[0] * rho[0, h // 2] for h in range(4)]).amax(dim=0)
    torch.testing.assert_close(scores[0], expected)
    # Relative to the layer's largest weight: scaling a layer's weights changes nothing.
    torch.testing.assert_close(head_weighted_scores(alpha, rho, weights * 0.7), scores)


@given(st.lists(st.floats(0.8, 1.5), min_size=6, max_size=6))
@settings(max_examples=40, deadline=None)
def test_within_a_kv_group_only_the_largest_weight_matters(weights):
    """The query heads of one KV group carry the same utility, so giving every head its group's largest weight
    changes nothing: a property of the spec's formula, and why W_head has one effective weight per KV group."""
    alpha = torch.rand(1, 12, generator=torch.Generator().manual_seed(1))
    rho = torch.rand(1, 2, 12, generator=torch.Generator().manual_seed(2))
    w = torch.tensor(weights)
    group_max = w.view(2, 3).amax(dim=1).repeat_interleave(3)
    torch.testing.assert_close(head_weighted_scores(alpha, rho, w), head_weighted_scores(alpha, rho, group_max))


def test_risk_signals():
    assert structural_risk(torch.ones(64)) == pytest.approx(math.log(64))
    assert structural_risk(torch.tensor([0.0, 5.0, 0.0])) == pytest.approx(0.0)
    assert semantic_risk(torch.tensor([-1.0, -3.0])) == pytest.approx(math.exp(2.0))


def test_quantile_edges_split_the_calibration_values_evenly_and_bins_count_edges_at_or_below():
    values = torch.arange(100, dtype=torch.float64)
    edges = quantile_edges(values, 4)
    assert edges.shape == (3,)
    counts = torch.bincount(torch.tensor([risk_bin(float(v), edges) for v in values]), minlength=4)
    assert counts.tolist() == [25, 25, 25, 25]
    assert risk_bin(float(edges[1]), edges) == 2  # an edge value belongs to the bin above it
    assert risk_bin(-1e9, edges) == 0 and risk_bin(1e9, edges) == 3


def test_elastic_gate_keeps_the_candidates_below_budget_and_clamps_above():
    scores = torch.tensor([0.5, 0.85, 0.95, 1.2, 3.0, float("inf")])
    assert candidate_count(scores, 0.9) == 4
    assert gated_count(scores, 0.9, budget=5) == 4  # elastic: fewer than the budget
    assert gated_count(scores, 0.8, budget=3) == 3  # clamped to the budget


def test_ratio_honest_gate_ranks_by_score_over_threshold_and_fills_the_total():
    inf = float("inf")
    scores = [torch.tensor([0.9, 0.5, inf]), torch.tensor([0.9, 0.45, inf]), torch.tensor([2.0, 0.1, inf])]
    thresholds = [1.0, 0.5, 1.0]  # margins: [0.9, 0.5, inf], [1.8, 0.9, inf], [2.0, 0.1, inf]
    assert pooled_counts(scores, thresholds, 3) == [1, 1, 1]  # the protected entries first
    assert pooled_counts(scores, thresholds, 5) == [1, 2, 2]  # then 2.0 and 1.8
    assert pooled_counts(scores, thresholds, 6) == [2, 2, 2]  # 0.9 twice: the earlier layer first
    assert pooled_counts(scores, thresholds, 7) == [2, 3, 2]
    assert pooled_counts(scores, thresholds, 20) == [3, 3, 3]  # never more than a layer has
    assert kept_counts(scores, thresholds, 2, elastic=False) == [2, 2, 2]
    assert kept_counts(scores, thresholds, 2, elastic=True) == [1, 2, 2]  # layer 0's 0.9 is below its threshold


def _tables(layers: int = 4, budgets=(128, 256)) -> CompilerKVTables:
    g = torch.Generator().manual_seed(0)
    return CompilerKVTables(
        budgets=budgets,
        head_reliability=0.8 + 0.7 * torch.rand(len(budgets), layers, 4, generator=g),
        risk_thresholds=0.8 + 0.2 * torch.rand(len(budgets), layers, 3, 2, generator=g),
        entropy_edges=torch.tensor([1.0, 2.0], dtype=torch.float64),
        perplexity_edges=torch.tensor([10.0], dtype=torch.float64),
    )


def test_budget_lookup_refuses_an_uncompiled_budget_unless_the_nearest_is_asked_for():
    tables = _tables()
    assert tables.budget_index(256) == 1
    with pytest.raises(KVRuntimeError, match="compiled for budgets 128, 256 tokens per layer, not 200"):
        tables.budget_index(200)
    assert tables.budget_index(200, nearest=True) == 1
    assert tables.budget_index(150, nearest=True) == 0


def test_tables_for_another_layer_count_interpolate_over_relative_depth():
    tables = _tables(layers=4)
    same = tables.for_layers(4)
    assert same is tables
    deeper = tables.for_layers(7)  # relative depths 0, 1/6, ..., 1 over compiled depths 0, 1/3, 2/3, 1
    torch.testing.assert_close(deeper.head_reliability[:, 0], tables.head_reliability[:, 0])
    torch.testing.assert_close(deeper.head_reliability[:, -1], tables.head_reliability[:, -1])
    torch.testing.assert_close(
        deeper.risk_thresholds[:, 1], 0.5 * (tables.risk_thresholds[:, 0] + tables.risk_thresholds[:, 1])
    )
    torch.testing.assert_close(interpolate_layers(torch.ones(2, 1, 3), 5), torch.ones(2, 5, 3))


def test_tables_refuse_values_outside_the_action_grids_and_inconsistent_shapes():
    tables = _tables()
    with pytest.raises(ArtifactError, match="head_reliability holds values outside"):
        CompilerKVTables(
            tables.budgets,
            tables.head_reliability * 2,
            tables.risk_thresholds,
            tables.entropy_edges,
            tables.perplexity_edges,
        )
    with pytest.raises(ArtifactError, match="tables disagree"):
        CompilerKVTables(
            tables.budgets,
            tables.head_reliability,
            tables.risk_thresholds[:, :, :2],
            tables.entropy_edges,
            tables.perplexity_edges,
        )
