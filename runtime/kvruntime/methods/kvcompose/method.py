"""KVCompose (Si Salem et al., 2025): composite tokens and a layer-adaptive global budget.

Each KV head ranks the context by its own score and keeps its own best tokens; a layer's heads share the slots
(composite tokens), so every head of a layer keeps the same number of entries and the cache stays dense. How many
each layer keeps comes from a global ranking of the layers' composite-token scores.

Modes:
- `compiled` (default): the layers' shares come from a `kvcompose_stats` artifact (the dynamic allocation,
  averaged over calibration prompts); the token scores from the last `window` queries of the single prefill
  (eq. 14-16 with the window as the task). The window itself always stays.
- `dynamic`: the paper's two-pass scoring on the prompt itself (task-agnostic: the prompt is fed again after
  itself), and the allocation computed on this prompt. Costs a second prefill and the attention rows of every
  token of the copy; for reference and short inputs.
`unstructured=True` is appendix A's variant: per-(layer, KV head) counts from one global ranking of every head's
scores, stored with memory='masked' (no extra memory saving over the dense layout; the quality upper bound).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...errors import KVRuntimeError
from ...math.allocation import apportion
from ...math.composite_tokens import kv_head_scores, prompt_allocation
from ...registry import option_fields
from ...requests.request import KeepPlan, Request
from ..base import LayerInputs, PrefillResult, ScoringMethod, Selection
from .spec import SPEC
from .stats import KVComposeStats


@dataclasses.dataclass
class KVCompose(option_fields(SPEC), ScoringMethod):  # its options (mode, unstructured): the registration's
    name = "kvcompose"
    stats: KVComposeStats | None = None

    def __post_init__(self) -> None:
        if self.mode == "compiled" and self.stats is None:
            raise KVRuntimeError(
                "kvcompose mode 'compiled' needs kvcompose_stats (compile them with `kvcompile stats`)"
            )

    def check_request(self, request: Request) -> None:
        if self.mode == "compiled" and request.ratio:
            self.stats.check_ratio(request.ratio)

    def layer_budgets(self, num_layers: int, plan: KeepPlan) -> list[int]:
        return self._compiled_counts(plan)[0].tolist()

    def budgets_note(self, plan: KeepPlan) -> str:
        return f"{self._compiled_counts(plan)[1]}; composite tokens"

    def _compiled_counts(self, plan: KeepPlan) -> tuple[torch.Tensor, str]:
        """The compiled shares as counts for this prompt ([L], or [L, Hkv] unstructured) and how they were had."""
        # A budget is served as the ratio it is of this prompt, within 1/N of a compiled ratio by that ratio.
        shares, how = self.stats.fractions(plan.ratio, self.unstructured, tolerance=1.0 / plan.length)
        counts = apportion(shares, plan.keep * shares.numel(), low=plan.window, high=plan.length)
        return counts, f"compiled allocation ({self.stats.task_mode} stats, {how})"

    def layer_statistics(self, layer: LayerInputs) -> torch.Tensor | None:
        # The dynamic mode scores in its second pass (`select`): nothing to gather from the window.
        return None if self.mode == "dynamic" else super().layer_statistics(layer)

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        """Eq. 14-16 with the window's queries as the task: max over them, per query head, then per KV head."""
        batch, num_kv_heads, groups, _, length = attention.shape
        return kv_head_scores(attention.amax(dim=-2).reshape(batch, num_kv_heads * groups, length), num_kv_heads)

    def select(self, statistics: list[torch.Tensor | None], plan: KeepPlan, prefill: PrefillResult) -> Selection:
        if self.mode == "dynamic":
            if prefill.input_ids is None:
                raise KVRuntimeError("kvcompose's dynamic mode feeds the prompt again: give token ids, not embeddings")
            # Eq. 15-16 on the second pass's task maxima [B, Hq, N] (the prompt fed again after itself).
            num_kv_heads = prefill.num_kv_heads
            statistics = [kv_head_scores(task_max, num_kv_heads) for task_max in prefill.second_pass_attention()]
        num_layers, (batch, num_kv_heads, length) = len(statistics), statistics[0].shape
        if batch != 1:
            raise KVRuntimeError(f"kvcompose selects for batch size 1 only (got {batch})")
        if self.mode == "dynamic":
            counts = prompt_allocation(torch.stack([s[0] for s in statistics]), plan.keep, self.unstructured)
            how = "dynamic allocation (two-pass scores on this prompt)"
        else:
            counts, how = self._compiled_counts(plan)
        if not self.unstructured:
            counts = counts[:, None].expand(num_layers, num_kv_heads)
        layout = "per-head counts, masked" if self.unstructured else "composite tokens"
        note = (
            f"kvcompose           {how}; {layout}; tokens kept per layer {int(counts.max(dim=1).values.min())}"
            f"-{int(counts.max(dim=1).values.max())} of {length}"
        )
        return Selection(statistics, counts.clone(), [note])


def build(compiled: Any, options: dict[str, object]) -> KVCompose:
    return KVCompose(stats=compiled, **options)
