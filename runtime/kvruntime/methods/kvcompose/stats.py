"""KVCompose's compiled statistics and how the runtime reads its allocation for a target ratio.

layer_fractions [ratios, layers]: share of its context each layer keeps (the global composite-token allocation,
averaged over the calibration prompts); head_fractions [ratios, layers, KV heads]: the same for the unstructured
variant. Between two compiled ratios the shares are interpolated linearly (the shares of every compiled ratio sum
to the kept share, so the interpolation does too); outside the compiled grid a ratio is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...artifacts.artifact import ArtifactReader
from ...errors import ArtifactError
from ...math.allocation import shares_at_ratio
from ...requests.serving import compiled_ratios
from .operating_points import check_compiled_ratio


@dataclasses.dataclass(frozen=True)
class KVComposeStats(ArtifactReader):
    kind = "kvcompose_stats"
    ratios: tuple[float, ...]  # the compiled target ratios, increasing
    layer_fractions: torch.Tensor  # [ratios, layers]
    head_fractions: torch.Tensor  # [ratios, layers, KV heads]
    task_mode: str  # how the calibration prompts were scored (task-agnostic or task-aware)

    def __post_init__(self) -> None:
        tensors = {
            "ratios": torch.tensor(self.ratios, dtype=torch.float64),
            "layer_fractions": self.layer_fractions,
            "head_fractions": self.head_fractions,
        }
        self.check_schema(tensors)
        if any(b <= a for a, b in zip(self.ratios, self.ratios[1:])):
            raise ArtifactError(f"kvcompose stats: compiled ratios {list(self.ratios)} are not increasing")
        for name, fractions in (("layer_fractions", self.layer_fractions), ("head_fractions", self.head_fractions)):
            if bool((fractions < 0).any() or (fractions > 1 + 1e-6).any()):
                raise ArtifactError(f"kvcompose stats: {name} holds shares outside [0, 1]")

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict[str, Any]) -> KVComposeStats:
        return cls(
            ratios=compiled_ratios(tensors["ratios"].tolist()),
            layer_fractions=tensors["layer_fractions"].double(),
            head_fractions=tensors["head_fractions"].double(),
            task_mode=str(params.get("task_mode", "unknown")),
        )

    def check_ratio(self, ratio: float) -> None:
        check_compiled_ratio(self.ratios, ratio)

    def fractions(self, ratio: float, per_head: bool, tolerance: float = 0.0) -> tuple[torch.Tensor, str]:
        """The compiled shares for `ratio` ([L] or [L, Hkv] with `per_head`) and how they were obtained; a ratio
        within `tolerance` of a compiled one is served by it."""
        nearest = min(self.ratios, key=lambda compiled: abs(compiled - ratio))
        ratio = nearest if abs(nearest - ratio) <= tolerance else ratio
        self.check_ratio(ratio)
        return shares_at_ratio(self.ratios, self.head_fractions if per_head else self.layer_fractions, ratio)
