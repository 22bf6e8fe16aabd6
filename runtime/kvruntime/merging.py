"""Merging what is evicted into what is kept (issue #74, the `merge` option of every method): each evicted entry's
value is folded into the kept entry of its KV head whose key is most alike, so the cache keeps the bytes of the
kept entries and some of what the others said. Keys stay as they were (RoPE needs each key's own position); an
evicted entry counts with the cosine of its key to the target's (not at all at 0 or below), a kept entry's own
value with 1. Pure tensor math."""

from __future__ import annotations

import torch

_ROWS = 1024  # evicted keys compared with the kept ones at a time: the similarities stay [rows x kept] per head


def merged_values(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The values of the entries at `kept` [B, Hkv, k] of a layer's `keys` and `values` [B, Hkv, N, D], each the
    weighted mean of its own value and the values of the evicted entries whose most alike kept key (cosine) it has,
    weighted by that cosine: [B, Hkv, k, D] in the values' dtype."""
    batch, heads, length, dim = keys.shape
    evicted = torch.ones(batch, heads, length, dtype=torch.bool, device=keys.device).scatter_(2, kept, False)
    gather = kept.unsqueeze(-1).expand(-1, -1, -1, dim)
    keys32 = keys.float()
    unit = keys32 / keys32.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    kept_unit = unit.gather(2, gather)
    sums = values.gather(2, gather).float()
    weights = torch.ones(sums.shape[:-1], device=keys.device)
    for start in range(0, length, _ROWS):
        rows = slice(start, min(start + _ROWS, length))
        similarity, target = (unit[:, :, rows] @ kept_unit.transpose(-1, -2)).max(dim=-1)
        weight = similarity.clamp(min=0) * evicted[:, :, rows]
        sums.scatter_add_(2, target.unsqueeze(-1).expand(-1, -1, -1, dim), weight.unsqueeze(-1) * values[:, :, rows])
        weights.scatter_add_(2, target, weight)
    return (sums / weights.unsqueeze(-1)).to(values.dtype)
