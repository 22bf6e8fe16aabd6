"""CompilerKV's risk-adaptive threshold gate: the prompt's two risk signals, their bins, and how the thresholds
decide what each layer keeps. Pure functions.

Structural risk: Shannon entropy (nats) of the global attention mass alpha / sum(alpha). Semantic risk: perplexity
of the observation window's own tokens under the model (teacher-forced, from the prefill). Both are binned with
quantile edges measured on the calibration prompts: bin = number of edges at or below the value.
"""

from __future__ import annotations

import math

import torch

from ...math.selection import pooled_top_counts


def structural_risk(alpha: torch.Tensor) -> float:
    """Entropy in nats of the attention-mass distribution over the prompt's tokens (alpha [N])."""
    p = alpha.double() / alpha.double().sum()
    return float(-(p * p.clamp_min(1e-300).log()).sum())


def semantic_risk(token_logprobs: torch.Tensor) -> float:
    """Local perplexity exp(-mean log p) of the window's tokens."""
    return math.exp(-float(token_logprobs.double().mean()))


def quantile_edges(values: torch.Tensor, bins: int) -> torch.Tensor:
    """The `bins - 1` inner edges at quantiles k / bins of the calibration values (float64 for exact ties)."""
    levels = torch.arange(1, bins, dtype=torch.float64) / bins
    return torch.quantile(values.double(), levels)


def risk_bin(value: float, edges: torch.Tensor) -> int:
    """Bin index in [0, len(edges)]: how many edges are at or below the value."""
    return int(torch.searchsorted(edges.double(), torch.tensor([value], dtype=torch.float64), right=True))


def candidate_count(scores: torch.Tensor, threshold: float) -> int:
    """How many tokens the gate admits: scores at or above the threshold (a protected window counts, its score is
    infinite). scores [N]."""
    return int((scores >= threshold).sum())


def gated_count(scores: torch.Tensor, threshold: float, budget: int) -> int:
    """Entries the layer keeps under the paper's elastic rule: every candidate while they fit in the budget (a
    low-risk prompt may keep fewer), else the budget (the top-B of the candidates, which are the top-B overall)."""
    return min(budget, candidate_count(scores, threshold))


def pooled_counts(scores: list[torch.Tensor], thresholds: list[float], total: int) -> list[int]:
    """Entries each layer keeps when the layers share `total` (the ratio-honest rule): the gate ranks, the budget
    fills. Every (layer, token) is ranked by how far its score stands above its layer's threshold (score /
    threshold), and the `total` highest stay, so a layer with a lower threshold keeps more. scores: [N] per layer
    (protected entries infinite); ties keep the earlier layer and token (the same in the compile stage's rollouts
    and at run time)."""
    margins = torch.stack([layer.double() / threshold for layer, threshold in zip(scores, thresholds)])
    return pooled_top_counts(margins, total).tolist()


def kept_counts(scores: list[torch.Tensor], thresholds: list[float], budget: int, elastic: bool) -> list[int]:
    """Entries each layer keeps for a budget per layer: the layers share budget x layers (ratio-honest), or each
    keeps its candidates up to the budget (`elastic`, the paper's rule)."""
    if elastic:
        return [gated_count(layer, threshold, budget) for layer, threshold in zip(scores, thresholds)]
    return pooled_counts(scores, thresholds, budget * len(scores))
