"""CompilerKV's prompt signals: what one prompt's prefill tells the risk gate and the stabilized utility.

The runtime method and the compile stage's experience collection (`kvcompile tables`) compute them the same way:
both call these functions."""

from __future__ import annotations

import dataclasses

import torch

from ...math.attention_logits import AttentionLogits
from ...math.selection import protect_window
from ...plumbing.window import window_attention
from .risk_gate import semantic_risk, structural_risk
from .stabilized_utility import (
    global_attention_mass,
    head_attention_mass,
    head_weighted_scores,
    mean_window_attention,
    relative_value_norms,
)

# One layer's share of the prompt signals: mean window attention [B, N], relative value norms [B, Hkv, N], and
# each query head's window attention mass [B, Hq, N].
LayerSignals = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class PromptSignals:
    """What CompilerKV measures on one prompt (batch size 1): alpha [N], rho [L, Hkv, N], each query head's own
    attention mass [L, Hq, N], the structural risk (entropy, nats) and the semantic risk (window perplexity)."""

    alpha: torch.Tensor
    rho: torch.Tensor
    head_mass: torch.Tensor
    entropy: float
    perplexity: float
    window: int


def layer_signals(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, logits: AttentionLogits
) -> LayerSignals:
    """One layer's share of the prompt signals."""
    attention = window_attention(queries, keys, logits)
    return mean_window_attention(attention), relative_value_norms(values), head_attention_mass(attention)


def prompt_signals(layers: list[LayerSignals], window_logprobs: torch.Tensor) -> PromptSignals:
    """Combine every layer's `layer_signals` and the window's token log-probabilities [B, w] (batch size 1)."""
    alpha = global_attention_mass([mass for mass, _, _ in layers])[0]
    return PromptSignals(
        alpha=alpha,
        rho=torch.stack([rho[0] for _, rho, _ in layers]),
        head_mass=torch.stack([head[0] for _, _, head in layers]),
        entropy=structural_risk(alpha),
        perplexity=semantic_risk(window_logprobs[0]),
        window=min(window_logprobs.shape[-1] + 1, alpha.shape[0]),
    )


def layer_scores(signals: PromptSignals, layer: int, head_weights: torch.Tensor, utility: str) -> torch.Tensor:
    """s [N] of one layer (`utility` one of UTILITIES) with its window protected (infinite score)."""
    head_mass = signals.head_mass[layer][None] if utility == "head" else None
    scores = head_weighted_scores(signals.alpha[None], signals.rho[layer][None], head_weights, head_mass)[0]
    return protect_window(scores, signals.window)
