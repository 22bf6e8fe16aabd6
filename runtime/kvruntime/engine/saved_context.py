"""A compressed context saved to a file and answered from in another process, without the document
(`artifacts/context_file.py` says what the file holds): `save_context` writes what `CompressionSession.prefill`
made, `load_context` checks a file against the model and gives a context that answers as the one saved did."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..artifacts.artifact import Artifact, read_artifact, save_artifact
from ..artifacts.context_file import (
    CONTEXT_KIND,
    PROMPT_FORMATS,
    QUESTION_SEPARATORS,
    ContextHeader,
    check_context_model,
    read_context_header,
)
from ..artifacts.fingerprint import model_fingerprint
from ..errors import ArtifactError, KVRuntimeError
from ..models.layout import is_window_layer, model_layout, window_length
from ..plumbing.attention import per_layer_attention
from ..report import CompressionReport
from .answering import CompressedContext
from .keep_masks import KeepMasks


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 of what a context's token ids mean: the vocabulary in id order and the special tokens' ids."""
    vocabulary = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    return hashlib.sha256(json.dumps([vocabulary, special]).encode()).hexdigest()


def save_context(
    context: CompressedContext,
    path: str | os.PathLike,
    tokenizer: Any,
    prompt_format: str = "raw",
    question_separator: str = "",
) -> Path:
    """Write a compressed context (one document, `CompressionSession.prefill`'s) to `path`, atomically: each
    layer's kept keys and values with their original positions, its keep masks, the model's fingerprint, the
    tokenizer's hash, how the document was framed (`prompt_format`: chat or raw; `question_separator`: what goes
    before a question's text) and how it was compressed."""
    report = context.report
    if len(context.context_lengths) != 1 or not isinstance(report, CompressionReport):
        raise KVRuntimeError(f"a context of {len(context.context_lengths)} rows: save one document at a time")
    if prompt_format not in PROMPT_FORMATS or question_separator not in QUESTION_SEPARATORS:
        raise KVRuntimeError(f"prompt_format {prompt_format!r} or question_separator {question_separator!r} unknown")
    layers = context.cache.layers
    if any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers):
        raise KVRuntimeError("a context quantized with kv_bits is not saved: save it without kv_bits")
    length = context.context_lengths[0]
    kept = dict(zip(report.layers or range(len(layers)), context.kept_positions))
    tensors = {}
    for index, layer in enumerate(layers):
        slots = layer.keys.shape[2]
        positions = kept.get(index)
        if positions is None:  # a sliding layer's window, or a layer kept whole: the last `slots` tokens
            positions = torch.arange(length - slots, length).expand(*layer.keys.shape[:2], slots)
        tensors |= {f"keys.{index}": layer.keys, f"values.{index}": layer.values}
        tensors[f"positions.{index}"] = positions.to(torch.int32)
    for index, mask in context.keep_masks.items():
        tensors[f"keep_mask.{index}"] = mask.bool()
    params = {
        "context_length": length,
        "layers": len(layers),
        "prompt_format": prompt_format,
        "question_separator": question_separator,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "method": report.method,
        "requested": report.requested,
        "memory": report.memory,
        "bytes_held": report.bytes_after,
        "bytes_full": report.bytes_before,
    }
    provenance = {"saved_by": "kvruntime.save_context", "created": datetime.datetime.now(datetime.UTC).isoformat()}
    model = model_fingerprint(context.session.model)
    return save_artifact(Artifact(CONTEXT_KIND, tensors, model, provenance, params), path)


class LoadedContext:
    """A saved context, checked against the model, answering as the context it was saved from: `generate` and
    `logits` as `CompressedContext`'s, for any number of rows (each a question after the same document)."""

    def __init__(self, session: ContextSession, header: ContextHeader, tensors: dict[str, torch.Tensor]) -> None:
        self.session = session
        self.header = header
        self.tensors = tensors
        self._by_rows: dict[int, CompressedContext] = {}  # each answer restores its context: built once per count

    @property
    def context_length(self) -> int:
        return self.header.context_length

    @property
    def bytes_held(self) -> int:
        """The bytes of the saved keys and values (the compressed cache of one row)."""
        return sum(t.nbytes for name, t in self.tensors.items() if name.startswith(("keys.", "values.")))

    def generate(self, question_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> object:
        return self._rows(question_ids, attention_mask).generate(question_ids, attention_mask, **kwargs)

    def logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._rows(ids, attention_mask).logits(ids, attention_mask)

    def _rows(self, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> CompressedContext:
        """The context for a row per question; padding would shift a sliding layer's band (as in memory)."""
        padded = attention_mask is not None and not bool(attention_mask.all())
        if padded:
            model_layout(self.session.model).check_unpadded()
        rows = ids.shape[0]
        if rows not in self._by_rows:
            self._by_rows[rows] = self.context(rows)
        return self._by_rows[rows]

    def context(self, rows: int) -> CompressedContext:
        """The saved context as a compressed context of `rows` rows (the document's cache for each)."""
        model = self.session.model
        cache = DynamicCache(config=model.config)
        length = self.header.context_length
        for index, layer in enumerate(cache.layers):
            keys, values = (self.tensors[f"{kind}.{index}"].expand(rows, -1, -1, -1) for kind in ("keys", "values"))
            layer.update(keys, values)
            if is_window_layer(layer):
                layer.cumulative_length = length  # the tokens it has seen, not the window it holds
        masks = {
            int(name.split(".")[1]): mask.expand(rows, -1, -1)
            for name, mask in self.tensors.items()
            if name.startswith("keep_mask.")
        }
        self.session.keep_masks.set(cache, masks)
        return CompressedContext(self.session, cache, [length] * rows, None)


class ContextSession:
    """What answering a loaded context needs of a session (`answering.AnsweringSession`): the model, and the keep
    masks of its caches given to its attention, while attached."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.keep_masks = KeepMasks()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def active(self) -> bool:
        return bool(self._handles)

    @contextlib.contextmanager
    def attached(self) -> Iterator[ContextSession]:
        for module in model_layout(self.model).cut_modules:
            self._handles.append(module.register_forward_pre_hook(self.keep_masks.injected, with_kwargs=True))
        try:
            with per_layer_attention(self.model):
                yield self
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []


@contextlib.contextmanager
def load_context(model: nn.Module, path: str | os.PathLike, tokenizer: Any = None) -> Iterator[LoadedContext]:
    """A context file checked against `model` (and `tokenizer`, when given) before any of it is used, then
    answered from inside the block. Refused in one line (ArtifactError): another model's or tokenizer's, a file
    truncated or corrupted, a tensor of another shape or dtype, a position out of range or out of order, a value
    not finite."""
    header = read_context_header(path)
    check_context_model(header, model_fingerprint(model))
    if tokenizer is not None and tokenizer_sha256(tokenizer) != header.tokenizer_sha256:
        raise ArtifactError(f"{header.describe()} with another tokenizer than this model's: save it again")
    tensors = read_artifact(header.path).tensors  # its checksum and finite values
    check_context_tensors(header, tensors, model)
    device = next(model.parameters()).device
    tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
    session = ContextSession(model)
    with session.attached():
        yield LoadedContext(session, header, tensors)


def check_context_tensors(header: ContextHeader, tensors: dict[str, torch.Tensor], model: nn.Module) -> None:
    """The tensors read are those the header declared (the file was not replaced in between), of the model's
    dtype, each sliding layer within its window, and each head's positions increasing within the context."""
    declared = {name: shape for name, (_, shape) in header.tensors.items()}
    if {name: tuple(tensor.shape) for name, tensor in tensors.items()} != declared:
        raise ArtifactError(f"{header.path}: its tensors changed while it was read")
    dtype = next(model.parameters()).dtype
    if tensors["keys.0"].dtype != dtype:
        raise ArtifactError(
            f"{header.path}: saved from the model in {tensors['keys.0'].dtype}, loaded here in {dtype}: load the "
            "model in the dtype it was saved from"
        )
    length, layers = header.context_length, DynamicCache(config=model.config).layers
    if len(layers) != header.layers:
        raise ArtifactError(
            f"{header.path}: a context of {header.layers} layers, where this model's cache has {len(layers)}"
        )
    for index, layer in enumerate(layers):
        positions = tensors[f"positions.{index}"].long()
        slots = positions.shape[-1]
        if is_window_layer(layer) and slots >= window_length(layer):
            raise ArtifactError(
                f"{header.path}: sliding layer {index} holds {slots} entries, past its {window_length(layer)}-token "
                "window"
            )
        inside = bool(((positions >= 0) & (positions < length)).all())
        if not inside or not bool((positions[..., 1:] > positions[..., :-1]).all()):
            raise ArtifactError(
                f"{header.path}: layer {index}'s positions are not increasing within the {length}-token context"
            )
