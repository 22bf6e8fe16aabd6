"""A key-geometry term for the student's scores: a key's leverage among the layer's keys, high for a key unlike the
others (an outlier direction, as Compactor scores them), low for one of many alike. The student ranks the copies of
a repeated text alike, so every layer would keep the same fragments of every copy; leverage ranks the copies apart
(measured in docs/methods/distilled.md). Pure functions, no model.
"""

from __future__ import annotations

import torch


def key_leverage(keys: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """[B, H, N, D] -> [B, H, N]: each key's leverage k_i^T (K^T K + ridge x mean(diag K^T K) I)^-1 k_i, the
    diagonal of the ridge hat matrix of the head's keys (the ridge keeps a prompt shorter than the head size
    solvable)."""
    keys = keys.float()
    gram = keys.transpose(-1, -2) @ keys
    eye = torch.eye(gram.shape[-1], device=keys.device)
    gram = gram + ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
    return (keys * torch.linalg.solve(gram, keys.transpose(-1, -2)).transpose(-1, -2)).sum(-1)


def with_leverage(scores: torch.Tensor, keys: torch.Tensor, beta: float, fresh: int) -> torch.Tensor:
    """Scores [B, Hkv, N] of a layer's entries with `beta` x their spread x the z-scored log leverage of the keys
    [B, Hkv, N, D] added to the last `fresh` entries (a streamed prompt's chunk: the earlier entries keep the scores
    they had when they came, their leverage among the keys held then). The protected entries (infinite scores) take
    no part in the z-score or the spread; a chunk with fewer than two others is left as it is."""
    if beta == 0 or fresh == 0:
        return scores
    scores = scores.clone()
    chunk = scores[..., -fresh:]
    free = chunk.isfinite().all(dim=0).all(dim=0)  # tokens no head protects
    if int(free.sum()) < 2:
        return scores
    log_leverage = key_leverage(keys).log()[..., -fresh:][..., free]
    z = (log_leverage - log_leverage.mean(-1, keepdim=True)) / log_leverage.std(-1, keepdim=True).clamp(min=1e-6)
    spread = chunk[..., free].std(-1, keepdim=True)
    chunk[..., free] += beta * spread * z
    return scores
