"""What the engine holds while one prompt goes through the model, and what a compressed prefill gives back."""

from __future__ import annotations

import dataclasses

import torch

from ..math.merging import ReferenceQueries
from ..report import CompressionReport
from ..requests.request import KeepPlan


@dataclasses.dataclass
class HeldEntries:
    """What a layer cut inside the prefill holds: its entries' original positions and scores [B, Hkv, held], and
    what the method carries to the layer's next chunk."""

    positions: torch.Tensor
    scores: torch.Tensor
    carry: object = None


@dataclasses.dataclass
class PrefillState:
    """Running state of one prompt's prefill: the prompt, each layer's statistics gathered so far (or, when layers
    are cut inside the prefill, their budgets and what they hold), the chunk going in, the largest cache held,
    timings."""

    length: int
    started: float
    input_ids: torch.Tensor | None
    plan: KeepPlan  # what this prompt keeps: decided once, here
    statistics: dict[int, object] = dataclasses.field(default_factory=dict)
    scoring_seconds: float = 0.0
    budgets: list[int] | None = None  # tokens each layer keeps, when every layer is cut right after its attention
    held: dict[int, HeldEntries] = dataclasses.field(default_factory=dict)
    chunks: int = 1  # the prompt went in this many chunks
    chunk_start: int = 0  # position of the first token of the chunk going in
    final_chunk: bool = True
    peak_bytes: int = 0  # the largest KV cache held at the end of an attention layer
    # Lookahead queries fed after the prompt in its own forward (`appended.py`): which (None: none for this prompt),
    # how many went in, and per layer their mean attention over the prompt [B, Hq, N], taken as each layer's ran.
    lookahead: torch.Tensor | None = None
    appended: int = 0
    lookahead_means: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    references: dict[int, ReferenceQueries] = dataclasses.field(default_factory=dict)  # per layer, for merge=refit

    def path(self) -> str:
        """Where the cache was cut, for the report."""
        if self.budgets is None:
            return "after the prefill (the method's selection needs every layer's scores or the whole prompt)"
        if self.chunks == 1:
            return "per layer, right after its attention"
        return f"per layer, after each of {self.chunks} chunks of the prompt"


@dataclasses.dataclass(frozen=True)
class Cut:
    """What cutting a prompt's cache kept: per layer its slots, its entries (over its KV heads), the original
    positions of the entries kept [B, Hkv, slots], and the keep masks of the layers whose heads keep fewer entries
    than their slots; and the report's notes on it."""

    slots: list[int]
    entries: list[int]
    kept_positions: list[torch.Tensor]
    masks: dict[int, torch.Tensor]
    notes: list[str]


@dataclasses.dataclass(frozen=True)
class Compressed:
    """A compressed prompt: its report and the original positions of the entries each layer kept (empty when the
    prompt was kept whole)."""

    report: CompressionReport
    kept_positions: list[torch.Tensor]


def chunk_bounds(length: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the chunks a prompt of `length` tokens goes in: `size` tokens each but the first, which takes
    the remainder, so that the last chunk holds the prompt's whole window."""
    first = length % size or size
    return [(0, first), *((start, start + size) for start in range(first, length, size))]
