"""CompressKV (2025): Semantic Retrieval Heads choose the tokens, per-layer budgets follow compression error.

`SemanticRetrievalHeads` ("srh"): in each layer, the top-4 SRH query heads' window attention (last 8 queries,
summed, average-pooled over 5 tokens, averaged over the 4 heads) gives one score per token, and one index set is
kept for every KV head of the layer. `WithLayerBudgets` ("<method>+budgets") gives any method the error-aware
per-layer budgets of Algorithm 1. "compresskv" is "srh+budgets".
"""

from __future__ import annotations

import dataclasses

import torch

from ..allocation import error_aware_budgets
from ..request import Request
from ..scores import pool_tokens
from .base import ScoringMethod


@dataclasses.dataclass
class SemanticRetrievalHeads(ScoringMethod):
    name = "srh"
    head_scores: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0, 0))  # [L, Hq]
    top_heads: int = 4
    window: int = 8
    kernel: int = 5

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        batch, kv_heads, groups, window, length = attention.shape
        per_query_head = attention.reshape(batch, kv_heads * groups, window, length)
        chosen = self.head_scores[layer].topk(min(self.top_heads, kv_heads * groups)).indices
        scores = pool_tokens(per_query_head[:, chosen].sum(dim=-2), self.kernel, "avg").mean(dim=1)
        return scores[:, None, :].expand(batch, kv_heads, length)


@dataclasses.dataclass
class WithLayerBudgets(ScoringMethod):
    inner: ScoringMethod | None = None
    layer_error: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))  # [L]

    def __post_init__(self) -> None:
        self.window = self.inner.window

    @property
    def name(self) -> str:  # type: ignore[override]
        return "compresskv" if isinstance(self.inner, SemanticRetrievalHeads) else f"{self.inner.name}+budgets"

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        return self.inner.token_scores(attention, layer)

    def budgets_note(self, request: Request, length: int) -> str:
        return "error-aware layer budgets (layer_budgets)"

    def layer_budgets(self, num_layers: int, request: Request, length: int) -> list[int]:
        return error_aware_budgets(self.layer_error.tolist(), request.kept_per_head(length, self.window), length=length)
