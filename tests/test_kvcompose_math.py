"""KVCompose's math against direct computations: task attention maxima, head scores, composite tokens, the global
allocations, the compiled shares' interpolation and their apportioning into counts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvruntime.errors import ArtifactError, KVRuntimeError
from kvruntime.math.allocation import apportion
from kvruntime.math.attention_logits import AttentionLogits
from kvruntime.math.composite_tokens import (
    composite_curve,
    head_allocation,
    kv_head_scores,
    layer_allocation,
    rank_quantile_values,
)
from kvruntime.methods.kvcompose.stats import KVComposeStats
from kvruntime.plumbing.second_pass import context_attention_max


@pytest.mark.parametrize("chunk", [1, 5, 256])
def test_context_attention_max_is_the_max_of_the_causal_softmax_rows_over_the_context(chunk):
    g = torch.Generator().manual_seed(0)
    context, task, groups = 11, 7, 3
    queries = torch.randn(1, 2 * groups, task, 8, generator=g)
    keys = torch.randn(1, 2, context + task, 8, generator=g)
    got = context_attention_max(queries, keys, AttentionLogits(0.3), context, chunk=chunk)
    expanded = keys.repeat_interleave(groups, dim=1)  # query head h uses KV head h // groups
    logits = queries @ expanded.transpose(-1, -2) * 0.3
    causal = torch.ones(task, context + task, dtype=torch.bool).tril(diagonal=context)
    probabilities = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    assert torch.allclose(got, probabilities[..., :context].amax(dim=-2), atol=1e-6)


def test_kv_head_scores_average_each_group_then_add_the_mean_over_kv_heads():
    task_max = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [0.0, 4.0], [2.0, 0.0]]])  # 4 query heads, 2 KV heads
    grouped = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
    assert torch.equal(kv_head_scores(task_max, 2)[0], grouped + grouped.mean(dim=0))


def test_composite_tokens_pair_each_heads_own_ranks_and_the_first_layer_is_lifted():
    scores = torch.tensor([[[0.1, 0.9, 0.5], [0.8, 0.2, 0.4]]])  # 2 heads rank different tokens first
    assert torch.allclose(composite_curve(scores)[0], torch.tensor([0.85, 0.45, 0.15]))
    curves = torch.tensor([[0.1, 0.05, 0.0], [0.9, 0.8, 0.1], [0.7, 0.2, 0.1]])
    # Without the lift layer 0 would keep nothing of the top 4; lifted to the max curve it keeps as much as layer 1.
    assert layer_allocation(curves, 4).tolist() == [2, 2, 0]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(2, 12), st.floats(0.05, 0.95), st.integers(0, 10**6))
def test_allocations_count_the_global_top_of_the_composite_and_the_per_head_scores(layers, heads, length, ratio, seed):
    scores = torch.rand(layers, heads, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ranked = scores.sort(dim=-1, descending=True).values
    total = max(1, int((1 - ratio) * layers * length))
    counts = layer_allocation(composite_curve(scores), total)
    assert int(counts.sum()) == total and bool((counts <= length).all())
    per_head = head_allocation(ranked, total * heads)
    threshold = ranked.flatten().sort(descending=True).values[total * heads - 1]
    assert per_head.tolist() == (ranked >= threshold).sum(dim=-1).tolist()


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5), st.integers(2, 12), st.floats(0.05, 0.95), st.integers(0, 10), st.integers(0, 10**6))
def test_a_floor_gives_every_layer_its_best_composite_tokens_and_the_rest_goes_to_the_global_top(
    layers, length, ratio, floor, seed
):
    curves = torch.rand(layers, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    curves = curves.sort(dim=-1, descending=True).values
    total = max(1, int((1 - ratio) * layers * length))
    counts = layer_allocation(curves, total, floor)
    guaranteed = min(floor, total // layers)
    assert int(counts.sum()) == total and bool((counts >= guaranteed).all())
    # Beyond the floors, the kept composite tokens are the best of any layer (layer 0 lifted): none dropped is better.
    lifted = curves.clone()
    lifted[0] = curves.max(dim=0).values
    kept = [float(lifted[layer, r]) for layer in range(layers) for r in range(guaranteed, int(counts[layer]))]
    dropped = [float(lifted[layer, r]) for layer in range(layers) for r in range(int(counts[layer]), length)]
    assert not kept or not dropped or min(kept) >= max(dropped)


def test_rank_quantiles_read_the_best_a_middle_rank_and_the_last():
    ranked = torch.arange(10.0, 0.0, -1.0)
    assert rank_quantile_values(ranked, torch.tensor([0.0, 4 / 9, 1.0])).tolist() == [10.0, 6.0, 1.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=30), st.integers(0, 200), st.integers(0, 40))
def test_apportion_sums_to_the_total_within_bounds_and_stays_within_one_of_the_exact_share(shares, low, extra):
    weights = torch.tensor(shares, dtype=torch.float64)
    high = low + extra + 1
    size = len(shares)
    total = (low * size + high * size) // 2
    counts = apportion(weights, total, low, high)
    assert int(counts.sum()) == total
    assert int(counts.min()) >= low and int(counts.max()) <= high
    exact = weights / weights.sum() * total if float(weights.sum()) > 0 else torch.full_like(weights, total / size)
    inside = (exact >= low + 1) & (exact <= high - 1)
    if bool(inside.all()):
        assert bool(((counts - exact).abs() < 1 + 1e-9).all())


def test_apportion_refuses_an_impossible_split():
    with pytest.raises(ValueError, match="cannot be split"):
        apportion(torch.ones(3), 10, 4, 8)


def _stats(**change) -> KVComposeStats:
    values = dict(
        ratios=(0.5, 0.75),
        layer_fractions=torch.tensor([[0.8, 0.2], [0.4, 0.1]], dtype=torch.float64),
        head_fractions=torch.tensor([[[0.9, 0.7], [0.3, 0.1]], [[0.5, 0.3], [0.1, 0.1]]], dtype=torch.float64),
        task_mode="task-agnostic",
    )
    return KVComposeStats(**{**values, **change})


def test_compiled_shares_are_exact_on_the_grid_interpolated_inside_and_refused_outside():
    stats = _stats()
    shares, how = stats.fractions(0.75, per_head=False)
    assert shares.tolist() == [0.4, 0.1] and how == "compiled ratio 0.75"
    shares, how = stats.fractions(0.625, per_head=True)
    assert torch.allclose(shares, torch.tensor([[0.7, 0.5], [0.2, 0.1]], dtype=torch.float64))
    assert how == "interpolated between compiled ratios 0.5 and 0.75"
    with pytest.raises(
        KVRuntimeError, match=r"ratio 0.9 is outside the compiled ratios of the kvcompose stats \(0.5 to 0.75"
    ):
        stats.fractions(0.9, per_head=False)
    assert stats.fractions(0.499, per_head=False, tolerance=0.01)[1] == "compiled ratio 0.5"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ratios": (0.75, 0.5)}, "are not increasing"),
        ({"ratios": (0.5,)}, "disagree"),
        ({"layer_fractions": torch.tensor([[1.5, 0.2], [0.4, 0.1]], dtype=torch.float64)}, "outside"),
    ],
)
def test_inconsistent_stats_are_refused(change, message):
    with pytest.raises(ArtifactError, match=message):
        _stats(**change)
