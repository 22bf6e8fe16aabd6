"""Per compressed cache, the masks of its layers whose heads keep fewer entries than their slots (`masked` memory, a
batch's padding): they belong to that cache's entries, and go when it goes."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from transformers import Cache


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
