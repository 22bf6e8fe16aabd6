"""CompilerKV's compiled tables and how the runtime looks them up: by compiled budget, by relative depth (a model
with another layer count), and by risk bin.

head_reliability [budgets, layers, query heads]: W_head, in [0.8, 1.5].
risk_thresholds  [budgets, layers, entropy bins, perplexity bins]: T_gate, in [0.8, 1.0].
The utility the tables were learned on (`signals.UTILITIES`) is a parameter of the artifact: the spec's ("global")
when an artifact does not say.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...artifacts.artifact import ArtifactReader
from ...errors import ArtifactError
from .operating_points import UTILITIES, compiled_budget_index
from .spec import THRESHOLD_RANGE

HEAD_WEIGHT_RANGE = (0.8, 1.5)


@dataclasses.dataclass(frozen=True)
class CompilerKVTables(ArtifactReader):
    kind = "compilerkv_tables"
    budgets: tuple[int, ...]  # the compiled budgets, tokens per layer
    head_reliability: torch.Tensor  # W_head [budgets, layers, query heads]
    risk_thresholds: torch.Tensor  # T_gate [budgets, layers, entropy bins, perplexity bins]
    entropy_edges: torch.Tensor  # inner edges of the entropy bins
    perplexity_edges: torch.Tensor  # inner edges of the window-perplexity bins
    utility: str = "global"  # the stabilized utility the tables were learned on
    elastic: bool | None = None  # the keep rule they were learned for (None: not recorded, older tables)

    def __post_init__(self) -> None:
        if self.utility not in UTILITIES:
            raise ArtifactError(f"utility {self.utility!r} is none of {', '.join(UTILITIES)}")
        tables = ("head_reliability", "risk_thresholds", "entropy_edges", "perplexity_edges")
        tensors = {"budgets": torch.tensor(self.budgets, dtype=torch.long), **{n: getattr(self, n) for n in tables}}
        self.check_schema(tensors)
        for name, table, (low, high) in (
            ("head_reliability", self.head_reliability, HEAD_WEIGHT_RANGE),
            ("risk_thresholds", self.risk_thresholds, THRESHOLD_RANGE),
        ):
            if bool((table < low - 1e-6).any() or (table > high + 1e-6).any()):
                raise ArtifactError(f"{name} holds values outside [{low}, {high}]")
        for name, edges in (("entropy_edges", self.entropy_edges), ("perplexity_edges", self.perplexity_edges)):
            if bool((edges.diff() < 0).any()):
                raise ArtifactError(f"{name} are not sorted")

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict[str, Any]) -> CompilerKVTables:
        return cls(
            budgets=tuple(int(b) for b in tensors["budgets"]),
            head_reliability=tensors["head_reliability"].float(),
            risk_thresholds=tensors["risk_thresholds"].float(),
            entropy_edges=tensors["entropy_edges"].double(),
            perplexity_edges=tensors["perplexity_edges"].double(),
            utility=params.get("utility", "global"),
            elastic=params.get("elastic"),
        )

    @property
    def num_layers(self) -> int:
        return self.head_reliability.shape[1]

    def budget_index(self, budget: int, nearest: bool = False) -> int:
        """The compiled budget's index; a budget not compiled is refused unless `nearest` is set."""
        return compiled_budget_index(self.budgets, budget, nearest)

    def for_layers(self, num_layers: int) -> CompilerKVTables:
        """The tables for a model with `num_layers` layers: linear interpolation over relative depth."""
        if num_layers == self.num_layers:
            return self
        return dataclasses.replace(
            self,
            head_reliability=interpolate_layers(self.head_reliability, num_layers),
            risk_thresholds=interpolate_layers(self.risk_thresholds, num_layers),
        )


def interpolate_layers(table: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Resample dim 1 (layers) of `table` at `num_layers` evenly spaced relative depths in [0, 1]."""
    compiled = table.shape[1]
    if compiled == 1:
        return table.expand(table.shape[0], num_layers, *table.shape[2:]).clone()
    position = torch.linspace(0, compiled - 1, num_layers, dtype=torch.float64)
    low = position.floor().long().clamp(max=compiled - 2)
    fraction = (position - low).to(table.dtype).view(1, -1, *([1] * (table.dim() - 2)))
    return table[:, low] * (1 - fraction) + table[:, low + 1] * fraction
