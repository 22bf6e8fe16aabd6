"""Which cache entries to keep: pure functions from scores and a budget to per-head counts and indices.

Shapes: layer scores are [B, Hkv, N]; counts are [L, Hkv] (entries kept per layer and KV head).
"""

from __future__ import annotations

import torch


def protect_window(scores: torch.Tensor, window: int) -> torch.Tensor:
    """The last `window` tokens always stay: give them infinite score."""
    protected = scores.clone()
    protected[..., -window:] = float("inf")
    return protected


def protect_sinks(scores: torch.Tensor, sinks: int) -> torch.Tensor:
    """The first `sinks` tokens always stay (attention sinks, as StreamingLLM keeps them): give them infinite
    score."""
    if sinks <= 0:
        return scores
    protected = scores.clone()
    protected[..., :sinks] = float("inf")
    return protected


def pooled_top_counts(scores: torch.Tensor, total: int) -> torch.Tensor:
    """One pool over every row's tokens (scores [..., N]): the `total` highest scores win, wherever they are; ties
    go to the earlier row and token (a stable order, so two callers ranking the same scores agree). Returns how
    many each row keeps: scores.shape[:-1]."""
    length = scores.shape[-1]
    winners = torch.sort(scores.flatten(), descending=True, stable=True).indices[:total]
    return torch.bincount(winners // length, minlength=scores[..., 0].numel()).view(scores.shape[:-1])


def global_head_counts(layer_scores: list[torch.Tensor], keep: int) -> torch.Tensor:
    """One pool over (layer, KV head, token): the keep * L * Hkv highest scores win, wherever they are.
    Batch size 1. Returns how many entries each (layer, KV head) keeps."""
    stacked = torch.stack([s[0] for s in layer_scores])  # [L, Hkv, N]
    return pooled_top_counts(stacked, keep * stacked.shape[0] * stacked.shape[1])


def top_indices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of each head's `count` best tokens, in sequence order: [B, Hkv, count]."""
    return scores.topk(count, dim=-1, sorted=False).indices.sort(dim=-1).values


def top_mask(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Boolean [B, Hkv, N]: True for each head's counts[h] best tokens (heads may keep different numbers)."""
    ranks = scores.argsort(dim=-1, descending=True).argsort(dim=-1)
    return ranks < counts.view(1, -1, 1).to(scores.device)
