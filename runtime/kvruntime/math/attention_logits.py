"""How a model turns query-key products into attention logits and probabilities: its scaling, the soft cap of a
model that caps its logits (Gemma 2), the learned sinks of one that has them (gpt-oss); which keys a query sees."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class AttentionLogits:
    """How the model turns query-key products into attention logits: scaled, then soft-capped (tanh) where the
    model caps them; and into probabilities: a softmax, with each query head's learned sink logit where the model
    has them (its weight dropped: the sink attends to nothing)."""

    scaling: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq]

    def __call__(self, products: torch.Tensor) -> torch.Tensor:
        return soft_capped(products * self.scaling, self.softcap)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Softmax of float32 logits grouped by KV head, [B, Hkv, G, q, N] (query head h = KV head h // G)."""
        if self.sinks is None:
            return logits.softmax(dim=-1)
        sink = self.sinks.float().reshape(1, *logits.shape[1:3], 1, 1).expand(*logits.shape[:-1], 1)
        return torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap * tanh(logits / cap)`, as Gemma caps its attention and final logits; the logits as they are for None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def right_aligned_causal_mask(q_len: int, kv_len: int, device: torch.device, band: int | None = None) -> torch.Tensor:
    """[q_len, kv_len] boolean mask: query i sees every key up to kv_len - q_len + i, and with a `band` only the
    `band` latest of them (a sliding window, as transformers bands it: query position minus key position below it)."""
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - q_len)
    if band is not None:
        mask &= torch.ones_like(mask).triu(diagonal=kv_len - q_len - band + 1)
    return mask
