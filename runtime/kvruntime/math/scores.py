"""Token scores from observation-window attention: pure functions, one per published metric.

Input: window attention probabilities [B, Hkv, G, w, N] (G query heads per KV head). Output: one score per
(KV head, token) [B, Hkv, N]; higher means more worth keeping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_tokens(scores: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """1-D pooling along the token axis (last dim), same length out; keeps neighbours of salient tokens."""
    if kernel <= 1:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif mode == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    else:
        raise ValueError(f"unknown pooling {mode!r} (use 'max' or 'avg')")
    return pooled.reshape(scores.shape)


def snapkv_scores(attention: torch.Tensor, kernel: int = 7) -> torch.Tensor:
    """SnapKV: attention summed over the window's queries, max-pooled, averaged over each KV group."""
    per_query_head = pool_tokens(attention.sum(dim=-2), kernel, "max")
    return per_query_head.mean(dim=2)


def kvcompress_scores(attention: torch.Tensor, kernel: int = 7) -> torch.Tensor:
    """KV-Compress (KVC-w): squared attention summed over the window's queries, max-pooled per query head,
    summed over the query heads of each KV group (query-group compression)."""
    per_query_head = pool_tokens(attention.square().sum(dim=-2), kernel, "max")
    return per_query_head.sum(dim=2)
