"""`<method>+error-aware`: a scoring method with CompressKV's error-aware per-layer budgets (Algorithm 1) from a
`layer_budgets` artifact: each layer keeps its budget of the method's own best entries, known before the prefill."""

from __future__ import annotations

import dataclasses

import torch

from ..math.allocation import error_aware_budgets
from ..registry import ERROR_AWARE, canonical_name
from ..requests.request import KeepPlan
from .base import ScoringMethod


@dataclasses.dataclass
class WithLayerBudgets(ScoringMethod):
    inner: ScoringMethod | None = None
    layer_error: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))  # [L]

    def __post_init__(self) -> None:
        self.window = self.inner.window

    @property
    def name(self) -> str:  # type: ignore[override]
        return canonical_name(f"{self.inner.name}+{ERROR_AWARE}")

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        return self.inner.token_scores(attention, layer)

    def budgets_note(self, plan: KeepPlan) -> str:
        return "error-aware layer budgets (layer_budgets)"

    def layer_budgets(self, num_layers: int, plan: KeepPlan) -> list[int]:
        return error_aware_budgets(self.layer_error.tolist(), plan.keep, length=plan.length)
