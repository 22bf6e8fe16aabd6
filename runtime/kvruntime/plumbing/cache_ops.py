"""Cache plumbing: hand over and find the cache, check its layers, keep entries, count bytes."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from ..errors import UnsupportedModelError
from ..math.merging import ReferenceQueries, kept_values
from ..models.layout import is_window_layer
from .quantized_cache import layer_bytes


def cache_argument(model: nn.Module, cache: Cache | None) -> dict[str, Cache | None]:
    """The keyword argument that hands `cache` to the model's forward or `generate`: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name is deprecated, then removed)."""
    return {_cache_keyword(type(model.base_model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    # Once per model class: compilerkv's rollouts hand a cache to every layer of every variant.
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def hooked_cache(kwargs: dict) -> Cache | None:
    """The cache a hooked forward was called with, under either name (`cache_argument`)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def output_cache(output: object) -> Cache | None:
    """The cache a forward returned, under either name (`cache_argument`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def check_growing_layer(layer: object, index: int) -> None:
    """Refuse to cut a cache layer that is not a plain growing one (a static, offloaded or quantized layer)."""
    if type(layer) is not DynamicLayer:
        raise UnsupportedModelError(
            f"cache layer {index} is a {type(layer).__name__}; only full-attention DynamicLayer caches are "
            "compressed (no static, offloaded or quantized caches)"
        )


def cache_bytes(cache: Cache) -> int:
    """Bytes the cache's tensors hold (layers a prefill has not reached yet hold none; a quantized layer its
    quantized states, scales and full-precision residual: `layer_bytes`)."""
    return sum(layer_bytes(layer) for layer in cache.layers if layer.is_initialized)


def uncompressed_bytes(cache: Cache, length: int) -> int:
    """Bytes the cache's layers hold with the prompt's `length` entries per KV head where they grow (what the full
    cache of the prompt holds); a sliding-window layer, never cut, holds what it holds."""
    total = 0
    for layer in cache.layers:
        entries = layer.keys.shape[-2] if is_window_layer(layer) else length
        per_entry = layer.keys[..., :1, :].numel() * layer.keys.element_size()
        total += entries * (per_entry + layer.values[..., :1, :].numel() * layer.values.element_size())
    return total


def own_window_storage(cache: Cache) -> None:
    """Give each sliding-window layer storage of its window alone (`own_window_storage_of`)."""
    for layer in cache.layers:
        if is_window_layer(layer) and layer.is_initialized:
            own_window_storage_of(layer)


def own_window_storage_of(layer: object) -> None:
    """After a prefill a sliding-window layer is a view of the whole prompt's keys and values, which it would hold
    until its next update: a copy of its window lets the prompt's go (as a cut layer's gather does)."""
    if layer.keys.untyped_storage().nbytes() > layer.keys.numel() * layer.keys.element_size():
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()


def bounded_bytes(cache: Cache) -> int:
    """Bytes the cache's sliding-window layers hold: bounded by the model, left as they are."""
    return sum(layer_bytes(layer) for layer in cache.layers if layer.is_initialized and is_window_layer(layer))


def keep_entries(
    layer: DynamicLayer, indices: torch.Tensor, merge: str = "off", reference: ReferenceQueries | None = None
) -> None:
    """Replace the layer's keys and values by the entries at `indices` [B, Hkv, k] (new, smaller storage), what is
    evicted merged into the values kept by `merge` (`merging.kept_values`; `refit` fits them to `reference`)."""
    indices = indices.to(layer.keys.device)
    values = kept_values(layer.keys, layer.values, indices, merge, reference)
    layer.keys = layer.keys.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1]))
    layer.values = values


def replace_output(output: object, hidden_states: torch.Tensor, cache: Cache) -> object:
    """A base model's output with other hidden states and cache (under the cache's name, `cache_argument`)."""
    output.last_hidden_state = hidden_states
    setattr(output, "cache" if getattr(output, "cache", None) is not None else "past_key_values", cache)
    return output


@contextlib.contextmanager
def restored_after(cache: Cache) -> Iterator[None]:
    """What enters `cache` inside the block (a question, an answer) is gone after it, zero-copy: transformers' cache
    update makes new tensors, and the originals are put back."""
    # Every attribute: a quantized layer holds its states, residual and length beside its keys and values.
    saved = [dict(vars(layer)) for layer in cache.layers]
    try:
        yield
    finally:
        for layer, state in zip(cache.layers, saved):
            vars(layer).clear()
            vars(layer).update(state)
