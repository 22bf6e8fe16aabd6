"""The distilled scorer's compiled weights and how the runtime reads them.

weights [layers, features, KV heads]: per layer, a linear map from a token's features (`features.py`) to the log of
the oracle's score for each KV head (ridge regression, `kvcompile distill`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...artifact import ArtifactReader


@dataclasses.dataclass(frozen=True)
class DistilledScorer(ArtifactReader):
    kind = "distilled_scorer"
    weights: torch.Tensor  # [layers, features, KV heads]
    oracle: str  # what the scores were distilled from (the second pass `kvcompile distill` ran, `oracle.py`)
    task_prefix: tuple[int, ...] = ()  # the token ids that second pass fed before the copy of the context

    def __post_init__(self) -> None:
        self.check_schema({"weights": self.weights})

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict[str, Any]) -> DistilledScorer:
        return cls(
            weights=tensors["weights"].float(),
            oracle=str(params.get("oracle", "unknown")),
            task_prefix=tuple(int(i) for i in params.get("task_prefix", ())),
        )
