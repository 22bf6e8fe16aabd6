"""Model and cache plumbing: find the attention modules, hand over and find the cache, check its layout, keep
entries, count bytes."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from .errors import UnsupportedModelError
from .quantized_cache import layer_bytes

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules in layer order, checked to be a supported architecture."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    modules = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    return sorted(modules, key=lambda m: m.layer_idx)


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


def check_full_attention_cache(cache: Cache) -> None:
    for index, layer in enumerate(cache.layers):
        check_full_attention_layer(layer, index)


def check_full_attention_layer(layer: object, index: int) -> None:
    if type(layer) is not DynamicLayer:
        raise UnsupportedModelError(
            f"cache layer {index} is a {type(layer).__name__}; only full-attention DynamicLayer caches are "
            "compressed (no sliding-window, static or quantized caches)"
        )


def cache_bytes(cache: Cache) -> int:
    """Bytes the cache's tensors hold (layers a prefill has not reached yet hold none; a quantized layer its
    quantized states, scales and full-precision residual: `layer_bytes`)."""
    return sum(layer_bytes(layer) for layer in cache.layers if layer.is_initialized)


def uncompressed_bytes(cache: Cache, length: int) -> int:
    """Bytes the cache's layers hold with `length` entries per KV head (what the full cache of the prompt holds)."""
    return length * sum(
        (layer.keys[..., :1, :].numel() * layer.keys.element_size())
        + (layer.values[..., :1, :].numel() * layer.values.element_size())
        for layer in cache.layers
    )


def keep_entries(layer: DynamicLayer, indices: torch.Tensor) -> None:
    """Replace the layer's keys and values by the entries at `indices` [B, Hkv, k] (new, smaller storage)."""
    expanded = indices.unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1]).to(layer.keys.device)
    layer.keys = layer.keys.gather(2, expanded)
    layer.values = layer.values.gather(2, expanded)


def truncate(cache: Cache, length: int) -> None:
    """Keep each layer's first `length` entries (views: the storage is freed when the layer is next rebuilt).
    DynamicCache.crop would do this, but its argument changed meaning between transformers 5.2 and 5.23."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


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
