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

import torch

from ..allocation import apportion
from ..composite_tokens import kv_head_scores, prompt_allocation
from ..errors import KVRuntimeError
from ..kvcompose_stats import KVComposeStats
from .base import Prefill, ScoringMethod, Selection

MODES = ("compiled", "dynamic")


@dataclasses.dataclass
class KVCompose(ScoringMethod):
    name = "kvcompose"
    window: int = 32
    mode: str = "compiled"
    unstructured: bool = False
    stats: KVComposeStats | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise KVRuntimeError(f"unknown kvcompose mode {self.mode!r} (use one of {', '.join(MODES)})")
        if self.mode == "compiled" and self.stats is None:
            raise KVRuntimeError("kvcompose mode 'compiled' needs kvcompose_stats (compile them with `kvcompile stats`)")

    @property
    def task_pass(self) -> bool:  # type: ignore[override]
        return self.mode == "dynamic"

    @property
    def memory(self) -> str | None:  # type: ignore[override]
        return "masked" if self.unstructured else None

    def check_request(self, ratio: float | None, budget: int | None) -> None:
        if self.mode == "compiled" and ratio:
            self.stats.check_ratio(ratio)

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        """Eq. 14-16 with the window's queries as the task: max over them, per query head, then per KV head."""
        batch, num_kv_heads, groups, _, length = attention.shape
        return kv_head_scores(attention.amax(dim=-2).reshape(batch, num_kv_heads * groups, length), num_kv_heads)

    def task_statistics(self, task_maxima: list[torch.Tensor], num_kv_heads: int) -> list[torch.Tensor]:
        """The dynamic mode's scores, per layer [B, Hkv, N], from the scoring pass's task maxima [B, Hq, N]."""
        return [kv_head_scores(task_max, num_kv_heads) for task_max in task_maxima]

    def select(self, statistics: list[torch.Tensor], keep: int, prefill: Prefill) -> Selection:
        num_layers, (batch, num_kv_heads, length) = len(statistics), statistics[0].shape
        if batch != 1:
            raise KVRuntimeError(f"kvcompose selects for batch size 1 only (got {batch})")
        if self.mode == "dynamic":
            counts = prompt_allocation(torch.stack([s[0] for s in statistics]), keep, self.unstructured)
            how = "dynamic allocation (two-pass scores on this prompt)"
        else:
            # keep = N - floor(ratio * N): the ratio served is within 1/N of the one requested.
            shares, how = self.stats.fractions(1.0 - keep / length, self.unstructured, tolerance=1.0 / length)
            total = keep * shares.numel()
            counts = apportion(shares, total, low=min(self.window, length), high=length)
            how = f"compiled allocation ({self.stats.task_mode} stats, {how})"
        if not self.unstructured:
            counts = counts[:, None].expand(num_layers, num_kv_heads)
        layout = "per-head counts, masked" if self.unstructured else "composite tokens"
        note = (
            f"kvcompose           {how}; {layout}; tokens kept per layer {int(counts.max(dim=1).values.min())}"
            f"-{int(counts.max(dim=1).values.max())} of {length}"
        )
        return Selection(statistics, counts.clone(), [note])
