"""KV-Compress (Rehg, 2024), KVC-w variant: squared window attention of the last 8 queries, max-pooled, summed
over each query group; one global pool over layers and KV heads decides how many entries each keeps."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...math.scores import kvcompress_scores
from ...math.selection import global_head_counts
from ...registry import option_fields
from ...requests.request import KeepPlan
from ..base import ScoringMethod
from .spec import SPEC


@dataclasses.dataclass
class KVCompress(option_fields(SPEC), ScoringMethod):  # its options: the registration's (KVC-w: window 8)
    name = "kvcompress"
    kernel: int = 7  # max-pooling width over tokens

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        return kvcompress_scores(attention, self.kernel)

    def head_counts(self, layer_scores: list[torch.Tensor], plan: KeepPlan) -> torch.Tensor:
        return global_head_counts(layer_scores, plan.keep)


def build(compiled: Any, options: dict[str, object]) -> KVCompress:
    return KVCompress(**options)
