"""Answering after a compressed context: questions (generate) or teacher-forced tokens (logits) placed at their
original positions after the context, on its compressed cache, which is restored after each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn
from transformers import Cache

from ..errors import KVRuntimeError
from ..plumbing.batch_rows import with_appended
from ..plumbing.cache_ops import cache_argument, restored_after
from ..report import BatchReport, CompressionReport
from .keep_masks import KeepMasks


class AnsweringSession(Protocol):
    """What a compressed context reads of the session that made it (`session.CompressionSession`)."""

    model: nn.Module
    keep_masks: KeepMasks

    @property
    def active(self) -> bool: ...


class CompressedContext:
    """A context (or a batch of contexts) compressed without its question; answers questions one after another on
    the same cache."""

    def __init__(
        self,
        session: AnsweringSession,
        cache: Cache,
        context_lengths: list[int],
        report: CompressionReport | BatchReport | None,
        kept_positions: list[torch.Tensor] | None = None,
    ) -> None:
        self.session = session
        self.cache = cache
        self.context_lengths = context_lengths  # each row's own tokens
        self.report = report  # None for a context loaded from a file (`saved_context.py`)
        # Original positions of the entries each cut layer kept, [B, Hkv, slots] per layer in the order of the
        # report's `layers` (empty: the context was kept whole).
        self.kept_positions = kept_positions or []

    @property
    def keep_masks(self) -> dict[int, torch.Tensor]:
        """The keep masks of the compressed cache's layers (`masked` memory, a batch's padding), held with the cache
        they describe."""
        return self.session.keep_masks.of(self.cache)

    def generate(
        self, question_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **generate_kwargs
    ) -> object:
        """`model.generate` on the question `question_ids` [B, q] after the compressed context (a batch's questions
        left-padded, with their `attention_mask`); returns what generate returns (sequences start with the
        question). The compressed context is restored afterwards."""
        with self._answering(question_ids, attention_mask):
            return generate_after_context(
                self.session.model,
                self.cache,
                self.context_lengths,
                question_ids,
                attention_mask=attention_mask,
                **generate_kwargs,
            )

    def logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The model's logits [B, n, vocab] at every position of `ids` [B, n] after the compressed context, in one
        forward (teacher forcing: the logits at position i are those of the token after ids[:, : i + 1]); a batch's
        rows left-padded, with their `attention_mask`. The compressed context is restored afterwards."""
        with self._answering(ids, attention_mask):
            return logits_after_context(self.session.model, self.cache, self.context_lengths, ids, attention_mask)

    @contextlib.contextmanager
    def _answering(self, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Iterator[None]:
        """`ids` [B, n] may enter the cache inside the block; the context (and its keep masks) is restored after it."""
        if not self.session.active:
            raise KVRuntimeError(
                "answer questions inside the `with kvruntime.compress(...)` block that made the context"
            )
        if ids.shape[0] != len(self.context_lengths):
            raise KVRuntimeError(
                f"{ids.shape[0]} row(s) of tokens for a context of {len(self.context_lengths)} row(s): give one per row"
            )
        masks = self.keep_masks
        if attention_mask is not None and not bool(attention_mask.all()):
            # The question's padding enters the cache after the context: hidden from attention like the context's.
            heads = self.cache.layers[0].keys.shape[1]
            slots = [layer.keys.shape[2] for layer in self.cache.layers]
            masks = with_appended(masks, slots, heads, attention_mask)
        with self.session.keep_masks.masking(self.cache, masks), restored_after(self.cache):
            yield


def generate_after_context(
    model: nn.Module,
    cache: Cache,
    context_length: int | Sequence[int],
    question_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **generate_kwargs,
) -> object:
    """`model.generate` on `question_ids` [B, q] after contexts of `context_length` tokens (one, or one per row)
    held (compressed or not) in `cache`: each question takes its original positions after its full context. A
    batch's questions are left-padded, `attention_mask` [B, q] marking their tokens (the padding is not masked here:
    `CompressedContext.generate` hides it). A cache whose layers hold different lengths needs `per_layer_attention`
    around this call."""
    return model.generate(
        input_ids=question_ids,
        **_after_context(model, cache, context_length, question_ids, attention_mask),
        **generate_kwargs,
    )


def logits_after_context(
    model: nn.Module,
    cache: Cache,
    context_length: int | Sequence[int],
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits [B, n, vocab] at every position of `ids` [B, n] after contexts held in `cache`, in one forward,
    as `generate_after_context` places them (the tokens enter the cache: callers that reuse it restore it)."""
    with torch.no_grad():
        arguments = _after_context(model, cache, context_length, ids, attention_mask)
        return model(input_ids=ids, use_cache=True, logits_to_keep=0, **arguments).logits


def _after_context(
    model: nn.Module,
    cache: Cache,
    context_length: int | Sequence[int],
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> dict:
    """The arguments that put `ids` [B, q] after their contexts: the cache, each token's original position after
    its full context, and an attention mask over the context and the (left-padded) ids."""
    batch, length = ids.shape
    device = ids.device
    lengths = [context_length] * batch if isinstance(context_length, int) else list(context_length)
    if attention_mask is None:
        attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)
    offsets = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # a padded question's tokens count from 0 too
    positions = torch.tensor(lengths, device=device)[:, None] + offsets
    context_mask = torch.ones(batch, max(lengths), dtype=attention_mask.dtype, device=device)
    return dict(
        attention_mask=torch.cat([context_mask, attention_mask], dim=1),
        **cache_argument(model, cache),
        **explicit_positions(model, positions),
    )


def explicit_positions(model: nn.Module, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The arguments that give tokens their original positions ([n], or [B, n] per row) after a cut cache, whose
    length no longer says how far the sequence has gone: position ids, and cache positions for transformers < 5.3
    (kvpress's range), which derives them from the cache length (one row's: batches there are kvpress's own)."""
    rows = positions if positions.ndim == 2 else positions[None]
    explicit = {"position_ids": rows}
    if hasattr(model, "_get_initial_cache_position"):
        explicit["cache_position"] = rows[0]
    return explicit
