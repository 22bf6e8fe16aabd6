"""KVCompose's math (paper section 3): token scores from task attention, composite tokens, and the global
layer-adaptive allocation. Pure functions, batch size 1 for the allocations.

Shapes: task maxima are [B, Hq, N] (one per query head and context token), head scores [B, Hkv, N], and a
layer's composite curve [N] (composite token r = the r-th best entry of every KV head, scores averaged).
"""

from __future__ import annotations

import torch

QUERY_CHUNK = 256  # task queries whose attention rows are held at once: memory linear in the context, not quadratic


def context_attention_max(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, context_length: int, chunk: int = QUERY_CHUNK
) -> torch.Tensor:
    """Eq. 14 with Agg_task = max: the largest attention probability any task query gives each context token.

    queries [B, Hq, m, D] are the last m positions of keys [B, Hkv, K, D] (post-RoPE, causal among themselves);
    the context is the first `context_length` keys. Probabilities are normalised over every key a query sees,
    as in the model's own attention. Returns [B, Hq, context_length] in float32.
    """
    batch, num_query_heads, task_length, head_dim = queries.shape
    num_kv_heads, key_length = keys.shape[1], keys.shape[2]
    groups = num_query_heads // num_kv_heads
    first = key_length - task_length  # absolute position of the first task query
    keys32 = keys.float()
    best = torch.zeros(batch, num_kv_heads, groups, context_length, device=keys.device)
    for start in range(0, task_length, chunk):
        stop = min(start + chunk, task_length)
        grouped = queries[:, :, start:stop].float().view(batch, num_kv_heads, groups, stop - start, head_dim)
        visible = first + stop  # the chunk's last query sees keys [0, first + stop)
        logits = torch.einsum("bkgwd,bknd->bkgwn", grouped, keys32[:, :, :visible]) * scaling
        positions = torch.arange(first + start, first + stop, device=keys.device)
        future = torch.arange(visible, device=keys.device)[None, :] > positions[:, None]
        logits.masked_fill_(future, float("-inf"))
        probabilities = logits.softmax(dim=-1)[..., :context_length]
        best = torch.maximum(best, probabilities.amax(dim=-2))
    return best.view(batch, num_query_heads, context_length)


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


def layer_allocation(curves: torch.Tensor, total: int) -> torch.Tensor:
    """Eq. 20-22: tokens kept per layer, the layers' shares of the global top-`total` composite tokens.

    curves [L, N]. As in the reference implementation, layer 0's curve is first lifted to the largest curve of
    any layer, so the first layer keeps at least as much as any other. Returns [L] counts summing to `total`.
    """
    lifted = curves.clone()
    lifted[0] = curves.max(dim=0).values
    return _counts_of_top(lifted.reshape(-1), total, curves.shape[1], curves.shape[0])


def head_allocation(sorted_scores: torch.Tensor, total: int) -> torch.Tensor:
    """The unstructured variant (appendix A): entries kept per (layer, KV head), the shares of the global
    top-`total` of every head's sorted scores. sorted_scores [L, Hkv, N] -> [L, Hkv] counts."""
    num_layers, num_kv_heads, length = sorted_scores.shape
    counts = _counts_of_top(sorted_scores.reshape(-1), total, length, num_layers * num_kv_heads)
    return counts.view(num_layers, num_kv_heads)


def prompt_allocation(scores: torch.Tensor, keep: int, per_head: bool) -> torch.Tensor:
    """The allocation of one prompt from its scores [L, Hkv, N], for `keep` entries per (layer, KV head) on
    average: tokens per layer [L] (composite tokens), or per (layer, KV head) [L, Hkv] (the unstructured variant)."""
    num_layers, num_kv_heads, _ = scores.shape
    if per_head:
        return head_allocation(sorted_head_scores(scores), keep * num_layers * num_kv_heads)
    return layer_allocation(composite_curve(scores), keep * num_layers)


def _counts_of_top(pool: torch.Tensor, total: int, length: int, groups: int) -> torch.Tensor:
    winners = pool.topk(total, sorted=False).indices
    return torch.bincount(winners // length, minlength=groups)


def rank_quantile_values(sorted_scores: torch.Tensor, quantiles: torch.Tensor) -> torch.Tensor:
    """Descending-sorted scores [..., N] read at rank quantiles q in [0, 1] (0 = the best token): [..., Q]."""
    length = sorted_scores.shape[-1]
    ranks = (quantiles * (length - 1)).round().long().clamp(0, length - 1)
    return sorted_scores[..., ranks]
