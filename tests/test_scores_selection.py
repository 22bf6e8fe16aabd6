import pytest
import torch

from kvruntime.errors import KVRuntimeError
from kvruntime.math.scores import kvcompress_scores, pool_tokens, snapkv_scores
from kvruntime.math.selection import global_head_counts, protect_window, top_indices, top_mask
from kvruntime.requests.request import kept_per_head


def test_kept_per_head_ratio_budget_and_bounds():
    assert kept_per_head(1000, 8, ratio=0.5) == 500
    assert kept_per_head(1000, 8, ratio=0.0) == 1000
    assert kept_per_head(1000, 8, ratio=0.999) == 8  # never below the protected window
    assert kept_per_head(1000, 8, budget=256) == 256
    with pytest.raises(KVRuntimeError, match="larger than the prompt"):
        kept_per_head(100, 8, budget=256)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(KVRuntimeError, match="outside"):
            kept_per_head(100, 8, ratio=bad)
    with pytest.raises(KVRuntimeError, match="positive"):
        kept_per_head(100, 8, budget=0)
    with pytest.raises(KVRuntimeError, match="exactly one"):
        kept_per_head(100, 8, ratio=0.5, budget=10)


def test_pool_tokens_spreads_peaks_to_neighbours():
    scores = torch.zeros(1, 1, 9)
    scores[..., 4] = 1.0
    assert pool_tokens(scores, 3, "max")[0, 0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    avg = pool_tokens(scores, 3, "avg")[0, 0]
    torch.testing.assert_close(avg[3:6], torch.full((3,), 1 / 3))
    with pytest.raises(ValueError):
        pool_tokens(scores, 3, "median")


def test_kvcompress_squares_and_sums_over_query_group():
    attention = torch.zeros(1, 1, 2, 1, 4)  # one KV head, two query heads, one window query, four keys
    attention[0, 0, 0, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    attention[0, 0, 1, 0] = torch.tensor([0.0, 0.0, 0.9, 0.1])
    scores = kvcompress_scores(attention, kernel=1)
    torch.testing.assert_close(scores[0, 0], torch.tensor([0.25, 0.25, 0.81, 0.01]))


def test_snapkv_averages_over_query_group():
    attention = torch.zeros(1, 1, 2, 1, 4)
    attention[0, 0, 0, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    attention[0, 0, 1, 0] = torch.tensor([0.0, 0.0, 0.9, 0.1])
    torch.testing.assert_close(snapkv_scores(attention, kernel=1)[0, 0], torch.tensor([0.25, 0.25, 0.45, 0.05]))


def test_global_pool_moves_budget_to_the_salient_heads():
    layer_a = torch.tensor([[[9.0, 8.0, 7.0, 6.0], [0.1, 0.2, 0.3, 0.4]]])  # [B=1, Hkv=2, N=4]
    layer_b = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]]])
    counts = global_head_counts([layer_a, layer_b], keep=2)  # 2 * 2 layers * 2 heads = 8 entries in all
    # the 8 best: 9 8 7 6 (layer a, head 0), 5 (layer b, head 1), then three of layer b head 0's four 1.0s
    assert counts.tolist() == [[4, 0], [3, 1]]


def test_protect_window_and_top_selection():
    scores = protect_window(torch.tensor([[[5.0, 1.0, 4.0, 0.0, 0.0]]]), window=2)
    assert top_indices(scores, 3)[0, 0].tolist() == [0, 3, 4]
    mask = top_mask(torch.tensor([[[5.0, 1.0, 4.0], [1.0, 2.0, 3.0]]]), torch.tensor([1, 2]))
    assert mask[0].tolist() == [[True, False, False], [False, True, True]]
