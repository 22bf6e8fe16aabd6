"""A batch (left-padded, as transformers' generation pads) prefilled row by row: each row's own tokens go through
the model alone and are compressed exactly as that prompt alone would be; the rows' caches are then stacked into one
rectangular cache (each layer as long as its longest row, the slots after a row's entries hidden from attention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from transformers import Cache, DynamicCache

from ..errors import KVRuntimeError
from ..models.layout import ModelLayout
from ..plumbing.batch_rows import row_starts, stack_rows, stacked_visibility
from ..plumbing.cache_ops import cache_argument, cache_bytes, replace_output, uncompressed_bytes
from ..report import BatchReport
from .keep_masks import KeepMasks
from .state import Compressed


class RowsSession(Protocol):
    """What prefilling a batch's rows reads of the session (`session.CompressionSession`)."""

    model: nn.Module
    kv_bits: int | None
    layout: ModelLayout
    keep_masks: KeepMasks
    batch_reports: list[BatchReport]

    def compressed_forward(
        self, forward: Callable[..., object], *args: object, **kwargs: object
    ) -> tuple[object, Compressed | None]: ...


# What a row's forward does not take from the batch's: it has its own mask, positions and cache.
_BATCH_ONLY = ("attention_mask", "position_ids", "cache_position", "cache", "past_key_values")


def prefill_rows(
    session: RowsSession, forward: Callable[..., object], kwargs: dict, tokens_key: str, cache: Cache | None
) -> tuple[object, Compressed]:
    """A batch, or a padded prompt: each row's own tokens go through the model's `forward` alone, at batch size 1,
    and are compressed as that prompt alone would be (padding never enters a row's cache, each row keeps its own
    ratio or budget of its own length; second-pass methods and streaming work as alone). The rows' caches are
    then stacked into `cache`; returns the output (the rows' hidden states and the stacked cache) and the batch's
    report and kept positions."""
    tokens = kwargs[tokens_key]
    batch, length = tokens.shape[:2]
    if session.kv_bits is not None:
        raise KVRuntimeError("kv_bits quantizes one prompt at a time: give the prompts one by one")
    session.layout.check_unpadded()  # a row's sliding layers would be padded out of the order their band relies on
    starts = row_starts(kwargs.get("attention_mask"), batch, length)
    alone = {key: value for key, value in kwargs.items() if key not in _BATCH_ONLY}
    hidden, row_caches, row_reports, row_positions = None, [], [], []
    for row, start in enumerate(starts):
        row_cache = DynamicCache(config=session.model.config)
        row_tokens = tokens[row : row + 1, start:]
        arguments = {**alone, tokens_key: row_tokens, **cache_argument(session.model, row_cache)}
        output, compressed = session.compressed_forward(forward, **arguments)
        states = output.last_hidden_state
        if hidden is None:
            hidden = states.new_zeros(batch, length, states.shape[-1])
        # Right-aligned: a streamed prompt's output holds its last chunk only, as it does alone.
        hidden[row, length - states.shape[1] :] = states[0]
        row_caches.append(row_cache)
        if compressed is not None:
            row_reports.append(compressed.report)
        # A row short enough to keep whole was not cut: its entries are its positions in order.
        every = torch.arange(row_tokens.shape[1], device=tokens.device).expand(1, row_cache.layers[0].keys.shape[1], -1)
        kept = compressed.kept_positions if compressed is not None else []
        row_positions.append(kept or [every] * len(row_cache.layers))
    cache = cache if cache is not None else DynamicCache(config=session.model.config)
    masks, kept_positions = {}, []
    for index in range(len(row_caches[0].layers)):
        layers = [row_cache.layers[index] for row_cache in row_caches]
        cache.update(
            stack_rows([layer.keys for layer in layers]), stack_rows([layer.values for layer in layers]), index
        )
        visible = stacked_visibility(
            [layer.keys.shape[2] for layer in layers],
            [session.keep_masks.of(row_cache).get(index) for row_cache in row_caches],
            layers[0].keys.shape[1],
            tokens.device,
        )
        if visible is not None:
            masks[index] = visible
        kept_positions.append(stack_rows([positions[index] for positions in row_positions], fill=-1))
    session.keep_masks.set(cache, masks)
    report = BatchReport(row_reports, uncompressed_bytes(cache, length), cache_bytes(cache))
    session.batch_reports.append(report)
    return replace_output(output, hidden, cache), Compressed(report, kept_positions)
