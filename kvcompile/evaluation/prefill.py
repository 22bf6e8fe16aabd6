"""A context prefilled for one contestant, ready to answer: compressed by a kvruntime method, or held in
transformers' cache under a kvpress press (or none: the full cache), from its own forward or cut from the prompt's
shared prefill; timed, its peak memory and bytes held measured."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import DynamicCache

from kvcompile.evaluation.measure import PeakMemory
from kvruntime import generate_after_context, logits_after_context
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.attention import KEEP_MASK_KEYWORD, per_layer_attention
from kvruntime.plumbing.cache_ops import cache_argument, cache_bytes, restored_after
from kvruntime.plumbing.quantized_cache import quantize_cache
from kvruntime.plumbing.recording import PrefillRecording, recorded_prefill


@dataclasses.dataclass
class AnswerableContext:
    """A context prefilled (and compressed) by a contestant, ready to answer."""

    seconds: float  # prefill + compression
    peak_mib: float | None
    cache_bytes: int  # KV bytes held after compression
    generate: Callable[..., object]  # (question_ids, **generate kwargs) -> generate's output
    logits: Callable[..., torch.Tensor]  # (ids [B, n], attention_mask=None) -> logits [B, n, vocab], teacher forced
    shared: bool = False  # cut from a shared prefill (`seconds` adds its forward; peak memory not measured)


@dataclasses.dataclass
class SharedPrefill:
    """A prompt's context prefilled once with the full cache and recorded: the full cache answers from it, and every
    contestant that can cuts its copy from it (`PrefillRecording.replay`) instead of a prefill of its own."""

    recording: PrefillRecording
    seconds: float


def shared_prefill(model: nn.Module, context_ids: torch.Tensor) -> SharedPrefill:
    with PeakMemory(context_ids.device) as timer:
        started = time.perf_counter()
        recording = recorded_prefill(model, context_ids)
        return SharedPrefill(recording, timer.seconds_since(started))


@contextlib.contextmanager
def compressed_prefill(
    compressing: contextlib.AbstractContextManager, context_ids: torch.Tensor, shared: SharedPrefill | None = None
) -> Iterator[AnswerableContext]:
    """The context prefilled and compressed inside a `kvruntime.compress` block (`compressing`), timed, peak memory
    measured; answer inside the block. Cut from the `shared` prefill unless it streams: timed as the shared forward
    plus its hooks, peak memory not measured."""
    with compressing as session:
        replayed = shared is not None and session.replays(context_ids.shape[1])
        with PeakMemory(context_ids.device) as peak:
            started = time.perf_counter()
            compressed = session.compress_recording(shared.recording) if replayed else session.prefill(context_ids)
            seconds = peak.seconds_since(started) + (shared.seconds if replayed else 0.0)
        yield AnswerableContext(
            seconds,
            None if replayed else peak.mib,
            compressed.report.bytes_after,
            compressed.generate,
            compressed.logits,
            replayed,
        )


@contextlib.contextmanager
def cache_prefilled(
    model: nn.Module,
    press: object | None,
    kv_bits: int | None,
    context_ids: torch.Tensor,
    shared: SharedPrefill | None = None,
) -> Iterator[AnswerableContext]:
    """The context prefilled into transformers' cache under a kvpress press (None: the full cache, quantized to
    `kv_bits` if given), timed, peak memory measured; from the `shared` prefill where the press can be replayed on
    it (`replays`)."""
    replayed = shared is not None and (press is None or replays(press))
    with PeakMemory(context_ids.device) as peak:
        started = time.perf_counter()
        if replayed:
            cache = replayed_press(model, press, shared.recording)
        else:
            cache = DynamicCache(config=model.config)
            with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
                model(input_ids=context_ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
        seconds = peak.seconds_since(started) + (shared.seconds if replayed else 0.0)
    masks = press_keep_masks(model, cache, context_ids.shape[1])
    if kv_bits is not None:  # the full cache quantized (`full:kv_bits=N`)
        if replayed:  # the recording's cache is shared by the prompt's other runs: quantize a list of its layers
            cache = copy.copy(cache)
            cache.layers = list(cache.layers)
        quantize_cache(cache, kv_bits)

    @contextlib.contextmanager
    def answering() -> Iterator[None]:
        # Presses may leave layers of different lengths (per-layer attention) or hide entries (keep masks); what
        # a question or an answer adds to the cache is gone after it, so that the context answers again.
        with per_layer_attention(model), keep_mask_hooks(model, masks), restored_after(cache):
            yield

    def generate(question_ids: torch.Tensor, **kwargs) -> object:
        with answering():
            return generate_after_context(model, cache, context_ids.shape[1], question_ids, **kwargs)

    def logits(ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        with answering():
            return logits_after_context(model, cache, context_ids.shape[1], ids, attention_mask)

    yield AnswerableContext(
        seconds, None if replayed else peak.mib, held_bytes(cache, masks), generate, logits, replayed
    )


def replays(press: object) -> bool:
    """Whether a kvpress press does all its work in the forward hook kvpress's base press registers (then it can
    run on a recorded prefill); presses that add passes (KVzip) or hooks of their own cannot."""
    from kvpress.presses.base_press import BasePress

    kind = type(press)
    own_call = kind.__call__ is BasePress.__call__ or getattr(kind, "replays_recorded_prefill", False)
    return own_call and kind.forward_hook is BasePress.forward_hook


def replayed_press(model: nn.Module, press: object | None, recording: PrefillRecording) -> DynamicCache:
    """The cache a press (None: no compression) leaves after the recorded prefill, its hook run on each layer's
    recorded call."""
    if press is None:
        return recording.cache
    press.post_init_from_model(model)
    with torch.no_grad():
        cache, _ = recording.replay(model, press.forward_hook)
    return cache


def press_keep_masks(model: nn.Module, cache: DynamicCache, context_length: int) -> dict[int, torch.Tensor]:
    """The entries a masking press hides, as keep masks [1, Hkv, N] per layer. kvpress's KVzip (and AdaKV-style
    presses) do not remove entries: they leave `masked_key_indices` (batch, head, position) on each attention module
    for kvpress's attention patch, which the per-layer attention here does not go through. The indices are taken
    off the modules (so that no later run sees them), and what a scoring pass left beyond the context is freed."""
    for layer in cache.layers:
        # KVzip's reconstruction pass appends the copy, then cuts it off with a view that holds on to its storage.
        if layer.keys.shape[-2] > context_length or layer.keys.untyped_storage().nbytes() > layer.keys.nbytes:
            layer.keys = layer.keys[..., :context_length, :].clone()
            layer.values = layer.values[..., :context_length, :].clone()
    masks = {}
    for module in model_layout(model).cut_modules:
        indices = getattr(module, "masked_key_indices", None)
        if indices is None:
            continue
        del module.masked_key_indices
        layer = cache.layers[module.layer_idx]
        mask = torch.ones(layer.keys.shape[:3], dtype=torch.bool, device=layer.keys.device)
        mask[indices] = False
        masks[module.layer_idx] = mask
    return masks


@contextlib.contextmanager
def keep_mask_hooks(model: nn.Module, masks: dict[int, torch.Tensor]) -> Iterator[None]:
    """Pass each layer's keep mask to the per-layer attention while the block runs."""

    def inject(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, KEEP_MASK_KEYWORD: masks[module.layer_idx]}

    handles = [
        module.register_forward_pre_hook(inject, with_kwargs=True)
        for module in model_layout(model).cut_modules
        if module.layer_idx in masks
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def held_bytes(cache: DynamicCache, masks: dict[int, torch.Tensor]) -> int:
    """KV bytes held, counting a masked layer as a dense store of its heads' largest kept count (what the engine's
    `padded` memory holds for per-head counts): hidden entries are not counted as freed beyond that."""
    hidden = 0
    for index, mask in masks.items():
        layer, length = cache.layers[index], mask.shape[-1]
        unused_slots = length - int(mask.sum(dim=-1).max())
        hidden += (layer.keys.nbytes + layer.values.nbytes) * unused_slots // length
    return cache_bytes(cache) - hidden
