"""Per compressed cache, the masks of its layers whose heads keep fewer entries than their slots (`masked` memory, a
batch's padding): they belong to that cache's entries, and go when it goes."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from transformers import Cache

from ..plumbing.attention import KEEP_MASK_KEYWORD
from ..plumbing.cache_ops import hooked_cache


class KeepMasks:
    """Each cache's keep masks, by model layer id, held as long as the cache is."""

    def __init__(self) -> None:
        self._by_cache: weakref.WeakKeyDictionary[Cache, dict[int, torch.Tensor]] = weakref.WeakKeyDictionary()

    def of(self, cache: Cache) -> dict[int, torch.Tensor]:
        """The keep masks of `cache` ({} when every head shows all its slots)."""
        return self._by_cache.get(cache, {})

    def set(self, cache: Cache, masks: dict[int, torch.Tensor]) -> None:
        self._by_cache[cache] = masks

    def drop(self, cache: Cache) -> None:
        """`cache` starts a new sequence: an earlier prompt's masks do not apply to it."""
        self._by_cache.pop(cache, None)

    def injected(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """An attention module's arguments with its layer's keep mask of the cache it reads (a forward pre-hook's
        result; None: nothing to hide)."""
        cache = hooked_cache(kwargs)
        mask = self.of(cache).get(module.layer_idx) if cache is not None else None
        return None if mask is None else (args, {**kwargs, KEEP_MASK_KEYWORD: mask})

    @contextlib.contextmanager
    def masking(self, cache: Cache, masks: dict[int, torch.Tensor]) -> Iterator[None]:
        """`masks` hide entries of `cache` from attention inside the block (a question's padding beside the
        context's); the cache's own keep masks are back after it."""
        own = self.of(cache)
        self._by_cache[cache] = masks
        try:
            yield
        finally:
            self._by_cache[cache] = own
