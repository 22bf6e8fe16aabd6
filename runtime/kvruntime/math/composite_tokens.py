"""KVCompose's math (paper section 3): token scores from task attention, composite tokens, and the global
layer-adaptive allocation, which kvcompose, distilled and the compile stage share. Pure functions, batch size 1 for
the allocations.

Shapes: task maxima are [B, Hq, N] (`kvruntime.plumbing.second_pass`: one per query head and context token), head scores [B, Hkv, N], and a
layer's composite curve [N] (composite token r = the r-th best entry of every KV head, scores averaged).
"""

from __future__ import annotations

import torch


def kv_head_scores(task_max: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Eq. 15-16: mean over each KV group's query heads, plus the mean over KV heads (mild consistency).
    [B, Hq, N] -> [B, Hkv, N]."""
    batch, num_query_heads, length = task_max.shape
    grouped = task_max.view(batch, num_kv_heads, num_query_heads // num_kv_heads, length).mean(dim=2)
    return grouped + grouped.mean(dim=1, keepdim=True)


def sorted_head_scores(scores: torch.Tensor) -> torch.Tensor:
    """Eq. 17-18: each KV head's scores in descending order, [..., Hkv, N]: position r is composite token r."""
    return scores.sort(dim=-1, descending=True).values


def composite_curve(scores: torch.Tensor) -> torch.Tensor:
    """Eq. 19 with Agg_head = mean: the score of each composite token of one layer, [B, Hkv, N] -> [B, N]."""
    return sorted_head_scores(scores).mean(dim=-2)


def layer_allocation(curves: torch.Tensor, total: int, floor: int = 0) -> torch.Tensor:
    """Eq. 20-22: tokens kept per layer, the layers' shares of the global top-`total` composite tokens.

    curves [L, N]. As in the reference implementation, layer 0's curve is first lifted to the largest curve of
    any layer, so the first layer keeps at least as much as any other. `floor` composite tokens of every layer are
    kept whatever their scores (at most total / L): the rest goes to the global ranking. Returns [L] counts summing
    to `total`.
    """
    lifted = curves.clone()
    lifted[0] = curves.max(dim=0).values
    lifted[:, : min(floor, total // curves.shape[0])] = float("inf")
    return _counts_of_top(lifted.reshape(-1), total, curves.shape[1], curves.shape[0])


def head_allocation(sorted_scores: torch.Tensor, total: int) -> torch.Tensor:
    """The unstructured variant (appendix A): entries kept per (layer, KV head), the shares of the global
    top-`total` of every head's sorted scores. sorted_scores [L, Hkv, N] -> [L, Hkv] counts."""
    num_layers, num_kv_heads, length = sorted_scores.shape
    counts = _counts_of_top(sorted_scores.reshape(-1), total, length, num_layers * num_kv_heads)
    return counts.view(num_layers, num_kv_heads)


def prompt_allocation(scores: torch.Tensor, keep: int, per_head: bool, floor: int = 0) -> torch.Tensor:
    """The allocation of one prompt from its scores [L, Hkv, N], for `keep` entries per (layer, KV head) on
    average: tokens per layer [L] (composite tokens, each layer at least `floor`), or per (layer, KV head) [L, Hkv]
    (the unstructured variant)."""
    num_layers, num_kv_heads, _ = scores.shape
    if per_head:
        return head_allocation(sorted_head_scores(scores), keep * num_layers * num_kv_heads)
    return layer_allocation(composite_curve(scores), keep * num_layers, floor)


def _counts_of_top(pool: torch.Tensor, total: int, length: int, groups: int) -> torch.Tensor:
    # Ties go to the earlier group (layer 0's lifted curve ties the layer it was lifted to): a stable sort, where topk
    # would pick among them as it happens to.
    winners = pool.sort(descending=True, stable=True).indices[:total]
    return torch.bincount(winners // length, minlength=groups)


def rank_quantile_values(sorted_scores: torch.Tensor, quantiles: torch.Tensor) -> torch.Tensor:
    """Descending-sorted scores [..., N] read at rank quantiles q in [0, 1] (0 = the best token): [..., Q]."""
    length = sorted_scores.shape[-1]
    ranks = (quantiles * (length - 1)).round().long().clamp(0, length - 1)
    return sorted_scores[..., ranks]
