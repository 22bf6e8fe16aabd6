"""CompressKV (2025): Semantic Retrieval Heads choose the tokens, per-layer budgets follow compression error.

`SemanticRetrievalHeads` ("srh"): in each layer, the top-4 SRH query heads' window attention (last 8 queries,
summed, average-pooled over 5 tokens, averaged over the 4 heads) gives one score per token, and one index set is
kept for every KV head of the layer. "compresskv" is "srh+error-aware": with the error-aware per-layer budgets of
Algorithm 1 (`methods.layer_budgets`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...math.scores import pool_tokens
from ...registry import option_fields
from ..base import ScoringMethod
from .spec import SPEC


@dataclasses.dataclass
class SemanticRetrievalHeads(option_fields(SPEC), ScoringMethod):  # its options: the registration's
    name = "srh"
    head_scores: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0, 0))  # [L, Hq]
    top_heads: int = 4
    kernel: int = 5

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        batch, kv_heads, groups, window, length = attention.shape
        per_query_head = attention.reshape(batch, kv_heads * groups, window, length)
        chosen = self.head_scores[layer].topk(min(self.top_heads, kv_heads * groups)).indices
        scores = pool_tokens(per_query_head[:, chosen].sum(dim=-2), self.kernel, "avg").mean(dim=1)
        return scores[:, None, :].expand(batch, kv_heads, length)


def build(compiled: Any, options: dict[str, object]) -> SemanticRetrievalHeads:
    return SemanticRetrievalHeads(head_scores=compiled.tensors["srh_score"], **options)
