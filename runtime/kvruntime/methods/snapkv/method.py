"""SnapKV (Li et al., 2024): the baseline. Pooled window attention per KV head, the same budget in every layer.

Window 32 and max-pooling over 7 tokens, the SnapKV paper's LongBench setting, not kvpress's average pooling over 5:
with repeated filler in the window drawing most of the attention, averaging loses the pass key far more often
(docs/methods/snapkv.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...math.scores import snapkv_scores
from ...registry import option_fields
from ..base import ScoringMethod
from .spec import SPEC


@dataclasses.dataclass
class SnapKV(option_fields(SPEC), ScoringMethod):  # its options: the registration's (window: 32 queries)
    name = "snapkv"
    kernel: int = 7  # max-pooling width over tokens (see above)

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        return snapkv_scores(attention, self.kernel)


def build(compiled: Any, options: dict[str, object]) -> SnapKV:
    return SnapKV(**options)
