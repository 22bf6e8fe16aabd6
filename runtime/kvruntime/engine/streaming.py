"""A long prompt streamed in chunks (`prefill_chunk_size`): every chunk but the last goes through the model here,
each layer cut after each (`cut.cut_layer`), so the cache held never exceeds the budgets plus one chunk in one
layer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .answering import explicit_positions
from .state import PrefillState


def feed_earlier_chunks(
    model: nn.Module,
    forward: Callable[..., object],
    kwargs: dict,
    tokens_key: str,
    bounds: list[tuple[int, int]],
    state: PrefillState,
) -> dict:
    """Run every chunk but the last through the model's `forward`, and return the arguments of the last chunk,
    whose output is the prefill's. Positions are given explicitly: the cache, cut, no longer says how far the
    prompt has gone."""
    tokens = kwargs[tokens_key]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]

    def chunk_arguments(start: int, end: int) -> dict:
        sliced = {tokens_key: tokens[:, start:end], "attention_mask": None}
        return {**kwargs, **sliced, **explicit_positions(model, positions[0, start:end])}

    state.chunks = len(bounds)
    for start, end in bounds[:-1]:
        state.chunk_start, state.final_chunk = start, False
        forward(**chunk_arguments(start, end))
    state.chunk_start, state.final_chunk = bounds[-1][0], True
    return chunk_arguments(*bounds[-1])
