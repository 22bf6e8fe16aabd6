"""What the distilled scorer reads of each token, the same at compile time and at run time: the attention layer's
input (after its input norm), the token's position (log scale), whether it is the first token (attention sinks are
first tokens), how alike it is to the tokens before it (repeated text), and a bias. Pure functions, no model."""

from __future__ import annotations

import torch

EXTRA_FEATURES = 4  # bias, log1p(position), first token, likeness to the earlier tokens


def feature_count(hidden_size: int) -> int:
    """How many features a token has for a model of this hidden size (a scorer's weights have one row each)."""
    return hidden_size + EXTRA_FEATURES


def likeness_to_earlier(hidden_states: torch.Tensor) -> torch.Tensor:
    """[B, N, hidden] -> [B, N]: cosine of each token's state to the mean state of the tokens before it, the first
    token left out (a sink, unlike everything); 0 for the first two tokens. Causal: a token's value never depends on
    the tokens after it. Text that repeats scores near 1, and a second pass spreads its attention over the copies."""
    states = hidden_states.float()
    earlier = states[:, 1:-1].cumsum(dim=1)  # the sum of tokens 1..i-1, for tokens i = 2..N-1
    later = states[:, 2:]
    cosine = (later * earlier).sum(dim=-1) / (later.norm(dim=-1) * earlier.norm(dim=-1)).clamp(min=1e-6)
    return torch.cat([cosine.new_zeros(states.shape[0], min(2, states.shape[1])), cosine], dim=1)


def token_features(hidden_states: torch.Tensor) -> torch.Tensor:
    """[B, N, hidden] -> [B, N, feature_count(hidden)] in float32 (the fit's sums cast them to float64)."""
    batch, length, _ = hidden_states.shape
    positions = torch.arange(length, device=hidden_states.device, dtype=torch.float32)
    extra = torch.stack([torch.ones_like(positions), positions.log1p(), (positions == 0).float()], dim=-1)
    return torch.cat(
        [
            hidden_states.float(),
            extra.expand(batch, length, EXTRA_FEATURES - 1),
            likeness_to_earlier(hidden_states)[..., None],
        ],
        dim=-1,
    )


def oracle_targets(scores: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """What the student regresses on: the log of the oracle's scores (a token's largest attention from the second
    pass, in (0, 1]), so that the fit spreads over the whole ranking instead of the few largest values."""
    return scores.double().clamp(min=floor).log()


def predicted_scores(features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One layer's scores per KV head [B, Hkv, N] from its token features [B, N, F] and weights [F, Hkv]."""
    return (features.to(weights.dtype) @ weights).transpose(1, 2)
