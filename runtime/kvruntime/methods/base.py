"""What a compression method is to the engine: a token score from window attention, and a rule that turns
scores and a per-head budget into how many entries each (layer, KV head) keeps."""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import torch

from ..selection import protect_window, uniform_head_counts
from ..window_attention import window_attention


@dataclasses.dataclass
class Method(abc.ABC):
    """Subclasses set `name` and `window` and implement `token_scores`; override `head_counts` to move budget
    between layers and heads (the default keeps the same number everywhere)."""

    name: ClassVar[str]
    window: int = 32

    @abc.abstractmethod
    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        """Window attention [B, Hkv, G, w, N] of layer `layer` -> scores [B, Hkv, N]."""

    def window_scores(self, queries: torch.Tensor, keys: torch.Tensor, scaling: float, layer: int) -> torch.Tensor:
        """Token scores [B, Hkv, N] from the window's queries [B, Hq, w, D]; the window itself always stays."""
        return protect_window(self.token_scores(window_attention(queries, keys, scaling), layer), queries.shape[2])

    def head_counts(self, layer_scores: list[torch.Tensor], keep: int) -> torch.Tensor:
        """Entries kept per (layer, KV head), [L, Hkv], averaging `keep`. Scores already protect the window."""
        return uniform_head_counts(len(layer_scores), layer_scores[0].shape[1], keep)
