"""A plain prefill recorded so that compressions of the same prompt need no forward of their own.

In a prefill of one piece, a layer whose cache is cut right after its attention hands the next layer the same hidden
states as the full cache does (the cut changes what later tokens will see, not this pass), so every layer's call
is the same with or without compression. Recording those calls and the full cache once, a compression hook (the
engine's, a kvpress press's) can be run on them afterwards, layer by layer, over a cache rebuilt as the prefill
held it at that layer, and cuts what it would have cut in the forward. Each layer's last `RECORDED_QUERIES` queries
are recorded as the model computed them (`attention.capturing_queries`): a method whose window is longer prefills
for itself. A prompt streamed in chunks is not a prefill of one piece: its later chunks see what the earlier ones
kept."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..errors import KVRuntimeError
from ..models.layout import is_window_layer, model_layout
from .attention import AttentionLogits, capturing_queries, per_layer_attention
from .cache_ops import cache_argument, hooked_cache

RECORDED_QUERIES = 64  # the longest window of the shipped methods (compilerkv's)

# Called as an attention module's forward hook: (module, args, kwargs, output).
AttentionHook = Callable[[nn.Module, tuple, dict, tuple], object]


@dataclasses.dataclass
class RecordedCall:
    """What an attention module was called with (its cache left out), its last queries, how it made them into logits
    and the attention weights it returned."""

    args: tuple
    kwargs: dict
    attentions: torch.Tensor | None
    queries: torch.Tensor
    logits: AttentionLogits


@dataclasses.dataclass
class PrefillRecording:
    """One prompt's plain prefill: its ids [1, N], the call of every attention layer whose cache grows, the full
    cache and the model's final hidden states."""

    input_ids: torch.Tensor
    calls: list[RecordedCall]
    cache: DynamicCache
    last_hidden_state: torch.Tensor

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def holds_the_whole_prompt(self) -> bool:
        """Whether every growing layer of the recorded cache holds the whole prompt (a recording made inside a
        `compress` block holds what that block kept)."""
        growing = [layer for layer in self.cache.layers if not is_window_layer(layer)]
        return all(layer.keys.shape[-2] == self.length for layer in growing)

    def replay(self, model: nn.Module, hook: AttentionHook) -> tuple[DynamicCache, BaseModelOutputWithPast]:
        """Call `hook` after each attention layer as the prefill would have, over a new cache that holds, when
        layer i's hook runs, what the prefill's did: the earlier layers as their hooks left them, layer i's full
        entries, nothing beyond (its sliding-window layers, never cut, as the prefill left them). The layer's recorded
        queries (and logits) are its captured ones while its hook runs. Returns that cache and the base model's output over it."""
        cache = DynamicCache(config=model.config)
        for index, layer in enumerate(self.cache.layers):
            if is_window_layer(layer):
                cache.layers[index] = copy.copy(layer)  # its own object: answering moves its window on
        modules = model_layout(model).cut_modules
        with capturing_queries(modules, RECORDED_QUERIES) as captures:
            for module, call, capture in zip(modules, self.calls, captures):
                layer = self.cache.layers[module.layer_idx]
                cache.update(layer.keys, layer.values, module.layer_idx)
                capture.queries, capture.logits = call.queries, call.logits
                kwargs = {**call.kwargs, **cache_argument(model, cache)}
                hook(module, call.args, kwargs, (None, call.attentions))
        return cache, BaseModelOutputWithPast(last_hidden_state=self.last_hidden_state, past_key_values=cache)


def recorded_prefill(model: nn.Module, input_ids: torch.Tensor) -> PrefillRecording:
    """Prefill `input_ids` [1, N] with the full cache (the forward `prefill` runs, without compression), recording
    it."""

    def record(module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> None:
        cache = hooked_cache(kwargs)
        kept = {key: value for key, value in kwargs.items() if value is not cache}
        attentions = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        capture = captures[positions[module]]
        calls.append(RecordedCall(args, kept, attentions, capture.queries, capture.logits))

    def record_output(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        outputs.append(output.last_hidden_state)

    calls: list[RecordedCall] = []
    outputs: list[torch.Tensor] = []
    cache = DynamicCache(config=model.config)
    modules = model_layout(model).cut_modules
    positions = {module: position for position, module in enumerate(modules)}
    with contextlib.ExitStack() as hooks, torch.no_grad():
        hooks.enter_context(per_layer_attention(model))
        captures = hooks.enter_context(capturing_queries(modules, RECORDED_QUERIES))
        for module in modules:
            hooks.callback(module.register_forward_hook(record, with_kwargs=True).remove)
        hooks.callback(model.base_model.register_forward_hook(record_output, with_kwargs=True).remove)
        model(input_ids=input_ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    return PrefillRecording(input_ids, calls, cache, outputs[0])


def check_replayable(recording: PrefillRecording, streamed_in: int | None, window: int) -> None:
    """Refuse a recording a session cannot compress as it compresses its own prefill: a prompt it streams in chunks
    (`streamed_in`: their size, None when it takes the prompt in one piece), a method window longer than the queries
    recorded, a recording of a cache compressed already."""
    if streamed_in is not None:
        raise KVRuntimeError(
            f"a prompt streamed in chunks of {streamed_in} tokens is not a recorded prefill of one piece"
        )
    if window > RECORDED_QUERIES:
        raise KVRuntimeError(f"a window of {window} queries is longer than a recording's {RECORDED_QUERIES}: prefill")
    if not recording.holds_the_whole_prompt():
        raise KVRuntimeError(
            "this recording holds a compressed cache (recorded inside a `kvruntime.compress` block): record the "
            "plain prefill before the block"
        )
