"""SnapKV (Li et al., 2024): the baseline. Pooled window attention per KV head, the same budget in every layer.

Window 32 and max-pooling over 7 tokens, the SnapKV paper's LongBench setting. kvpress's default (average pooling
over 5) lost the pass key in 4 of 5 prompts at ratio 0.5 on the default model, where repeated filler in the
window draws most of the attention; max-pooling over 7 lost 1 of 5 (measured on prompts not used in the tests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...scores import snapkv_scores
from ..base import ScoringMethod


@dataclasses.dataclass
class SnapKV(ScoringMethod):
    name = "snapkv"
    window: int = 32  # the last 32 queries (observation window)
    kernel: int = 7  # max-pooling width over tokens (see above)

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        return snapkv_scores(attention, self.kernel)


def build(compiled: Any, options: dict[str, object]) -> SnapKV:
    return SnapKV(**options)
