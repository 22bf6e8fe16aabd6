"""What the distilled scorer reads of each token, the same at compile time and at run time: the attention layer's
input (after its input norm), the token's position (log scale) and whether it is the first token (attention sinks
are first tokens), and a bias. Pure functions, no model."""

from __future__ import annotations

import torch

POSITION_FEATURES = 3  # bias, log1p(position), first token


def token_features(hidden_states: torch.Tensor) -> torch.Tensor:
    """[B, N, hidden] -> [B, N, hidden + 3] in float64 (the ridge fit's sums need it; the runtime casts down)."""
    batch, length, _ = hidden_states.shape
    positions = torch.arange(length, device=hidden_states.device, dtype=torch.float64)
    extra = torch.stack([torch.ones_like(positions), positions.log1p(), (positions == 0).double()], dim=-1)
    return torch.cat([hidden_states.double(), extra.expand(batch, length, POSITION_FEATURES)], dim=-1)


def oracle_targets(scores: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """What the student regresses on: the log of the oracle's scores (a token's largest attention from the second
    pass, in (0, 1]), so that the fit spreads over the whole ranking instead of the few largest values."""
    return scores.double().clamp(min=floor).log()


def predicted_scores(features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One layer's scores per KV head [B, Hkv, N] from its token features [B, N, F] and weights [F, Hkv]."""
    return (features.to(weights.dtype) @ weights).transpose(1, 2)
