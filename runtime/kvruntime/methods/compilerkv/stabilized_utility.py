"""CompilerKV's stabilized token utility and its head-weighted layer score: pure functions.

    alpha[t]   = (n / w) * sum over the window's queries j of mean over ALL layers and query heads of A[l,h,j,t]
    rho[l,k,t] = ||v[l,k,t]|| / mean_t' ||v[l,k,t']||           (per layer and KV head)
    u[l,h,t]   = alpha[t] * rho[l, h // g, t]                    (g query heads per KV head)
    s[l,t]     = max_h W[l,h] / max_h' W[l,h'] * u[l,h,t]        (weighted max-pooling over query heads)

alpha averages 1 over the tokens, and so does rho, which puts s on a scale of about 1 whatever the prompt: that is
what lets one table of thresholds in [0.8, 1.0] serve every prompt. The weights act relative to the layer's largest
(ours): a layer's own top-B is the same either way, but unscaled weights would also lift a layer's scores over its
threshold, so W_head would move entries between layers (or, under the elastic gate, grow the cache) and confound
head reliability with the gate's job. Note what the formula implies under GQA: the query heads of one KV group
carry the same utility, so within a group only the largest weight matters.

The head-aware utility (`utility="head"`, ours) lets every query head's weight matter, as the paper's weighted
max-pooling intends ("a reliable head can protect a token it attends to"): the attention part is the mean of the
global consensus and the head's own window attention, a[l,h,t] = (n / w) * sum_j A[l,h,j,t], which also averages 1:
    u[l,h,t]   = (alpha[t] + a[l,h,t]) / 2 * rho[l, h // g, t]
"""

from __future__ import annotations

import torch


def mean_window_attention(attention: torch.Tensor) -> torch.Tensor:
    """One layer's window attention [B, Hkv, G, w, N] averaged over its query heads and window queries: [B, N]."""
    return attention.mean(dim=(1, 2, 3))


def head_attention_mass(attention: torch.Tensor) -> torch.Tensor:
    """a [B, Hq, N]: each query head's own window attention [B, Hkv, G, w, N] summed over the window's queries and
    scaled by n / w (its mean over the tokens is 1, like alpha's)."""
    batch, kv_heads, groups, window, length = attention.shape
    return attention.sum(dim=3).reshape(batch, kv_heads * groups, length) * (length / window)


def global_attention_mass(layer_means: list[torch.Tensor]) -> torch.Tensor:
    """alpha [B, N] from every layer's `mean_window_attention`: n times their mean, which is (n / w) times the
    window's sum of the attention averaged over all layers and heads; its mean over the tokens is 1."""
    mean = torch.stack(layer_means).mean(dim=0)
    return mean * mean.shape[-1]


def relative_value_norms(values: torch.Tensor) -> torch.Tensor:
    """rho [B, Hkv, N]: each token's value norm over the mean norm of its layer and KV head (scale-free)."""
    norms = values.float().norm(dim=-1)
    return norms / norms.mean(dim=-1, keepdim=True).clamp_min(1e-12)


def head_weighted_scores(
    alpha: torch.Tensor, rho: torch.Tensor, head_weights: torch.Tensor, head_mass: torch.Tensor | None = None
) -> torch.Tensor:
    """s [B, N] of one layer: max over query heads of W[h] / max(W) * u[h]. alpha [B, N], rho [B, Hkv, N],
    head_weights [Hq]; with the layer's `head_attention_mass` [B, Hq, N], the head-aware utility, else the spec's."""
    groups = head_weights.shape[0] // rho.shape[1]
    attention = alpha[:, None, :] if head_mass is None else (alpha[:, None, :] + head_mass) / 2
    utility = attention * rho.repeat_interleave(groups, dim=1)  # [B, Hq, N]
    relative = head_weights.to(utility) / head_weights.max().to(utility)
    return (relative[None, :, None] * utility).amax(dim=1)
