"""Merging what is evicted into what is kept (issue #74, the `merge` option of every method); keys stay as they
were (RoPE needs each key's own position) and the bytes held are unchanged. Pure tensor math.

- `values`: each evicted entry's value is folded into the kept entry of its KV head whose key is most alike, so the
  cache keeps some of what the others said; an evicted entry counts with the cosine of its key to the target's (not
  at all at 0 or below), a kept entry's own value with 1.
- `refit`: the kept values are corrected, by least squares with a ridge toward their own, so that the prompt's last
  queries (the method's window, which every method has captured) read from the kept entries what they read from the
  whole prompt. The correction carries the evicted entries' share of attention, which folding values cannot: a
  merged entry keeps one token's attention logit, however many it stands for."""

from __future__ import annotations

import dataclasses

import torch

from .attention_logits import AttentionLogits, right_aligned_causal_mask

_ROWS = 1024  # evicted keys compared with the kept ones at a time: the similarities stay [rows x kept] per head
# The ridge of `refit`, relative to the mean squared attention row of the kept entries: small enough that the queries
# read nearly what the whole prompt gives them, large enough that a value no query reads stays its own.
REFIT_RIDGE = 0.1


@dataclasses.dataclass(frozen=True)
class ReferenceQueries:
    """A layer's last queries [B, Hq, m, D] (causal over its entries, right-aligned) and how the layer makes
    their products with its keys into logits: what `refit` fits the kept values to."""

    queries: torch.Tensor
    logits: AttentionLogits


def needs_reference_queries(merge: str) -> bool:
    """Whether a cut by `merge` reads the layer's reference queries (`kept_values`): the refit fits to them."""
    return merge == "refit"


def kept_values(
    keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, merge: str, reference: ReferenceQueries | None
) -> torch.Tensor:
    """The values [B, Hkv, k, D] the entries at `kept` [B, Hkv, k] hold after the cut, by `merge` (the option's
    values: off, values, refit; refit needs the layer's `reference` queries)."""
    if merge == "values":
        return merged_values(keys, values, kept)
    if needs_reference_queries(merge):
        if reference is None:
            raise ValueError("merge=refit needs the layer's reference queries")
        return refitted_values(keys, values, kept, reference.queries, reference.logits)
    return values.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))


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


def refitted_values(
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    queries: torch.Tensor,
    logits: AttentionLogits,
    ridge: float = REFIT_RIDGE,
) -> torch.Tensor:
    """The values of the entries at `kept` [B, Hkv, k] of a layer's `keys` and `values` [B, Hkv, N, D], corrected so
    that `queries` [B, Hq, m, D] (the layer's last m positions, causal) read from the kept entries what they read
    from all N: V_kept + A^T (A A^T + lambda I)^-1 (O - A V_kept) per KV head, where A [g*m, k] is the attention of
    its g query heads' queries over the kept entries and O their output over every entry; lambda is `ridge` times
    the mean of A A^T's diagonal. [B, Hkv, k, D] in the values' dtype."""
    batch, kv_heads, length, dim = keys.shape
    groups, count = queries.shape[1] // kv_heads, queries.shape[2]
    grouped = queries.float().reshape(batch, kv_heads, groups * count, queries.shape[-1])
    visible = right_aligned_causal_mask(count, length, keys.device).repeat(groups, 1)  # [g*m, N]
    scores = logits(grouped @ keys.float().transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    output = scores.softmax(dim=-1) @ values.float()  # what the whole prompt gives them [B, Hkv, g*m, D]
    kept_scores = scores.gather(-1, kept.unsqueeze(2).expand(-1, -1, groups * count, -1))
    reading = kept_scores.softmax(dim=-1).nan_to_num(0.0)  # A [B, Hkv, g*m, k]; a row that sees none reads none
    held = values.float().gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
    gram = reading @ reading.transpose(-1, -2)
    damping = ridge * gram.diagonal(dim1=-2, dim2=-1).mean(dim=-1).clamp(min=1e-12)
    gram = gram + damping[..., None, None] * torch.eye(gram.shape[-1], device=gram.device)
    correction = reading.transpose(-1, -2) @ torch.linalg.solve(gram, output - reading @ held)
    return (held + correction).to(values.dtype)
