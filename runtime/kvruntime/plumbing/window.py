"""Observation-window attention: the attention of the prompt's last `window` queries over all its keys.

The scoring methods need it in every layer whose cache they cut. Switching the model to eager attention would
materialise N x N weights in every layer (3.3x slower at 4k tokens on the default model); instead the window's
queries are taken where the model's attention runs (`attention.capturing_queries`: after its own projections,
norms and RoPE, whatever the architecture) and attended against the layer's cached keys, which transformers stores
after RoPE.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..models.layout import model_layout
from .attention import AttentionLogits, captured_queries, capturing_queries, per_layer_attention
from .cache_ops import hooked_cache


def hooked_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states an attention module was called with (its input, after the layer's input norm)."""
    return kwargs.get("hidden_states", args[0] if args else None)


def hooked_window_queries(
    attention: nn.Module, args: tuple, kwargs: dict, window: int
) -> tuple[torch.Tensor, object, int]:
    """From a forward hook's call of an attention module whose queries are captured: its last `window` queries
    (at most the query length), the layer's cache layer (keys and values already updated), and the query length."""
    query_length = hooked_input(args, kwargs).shape[1]
    cache_layer = hooked_cache(kwargs).layers[attention.layer_idx]
    return captured_queries(attention, min(window, query_length)), cache_layer, query_length


def window_attention(queries: torch.Tensor, keys: torch.Tensor, logits: AttentionLogits) -> torch.Tensor:
    """Softmax attention of the window's queries over all keys, in float32, causal inside the window.

    queries [B, Hq, w, D], keys [B, Hkv, N, D] -> probabilities [B, Hkv, Hq // Hkv, w, N]
    (query head h belongs to KV head h // (Hq // Hkv), as in transformers' repeat_kv).
    """
    batch, num_query_heads, window, head_dim = queries.shape
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    grouped = queries.float().view(batch, num_kv_heads, num_query_heads // num_kv_heads, window, head_dim)
    scores = logits(torch.einsum("bkgwd,bknd->bkgwn", grouped, keys.float()))
    future = torch.ones(window, window, dtype=torch.bool, device=keys.device).triu(diagonal=1)
    scores[..., length - window :].masked_fill_(future, float("-inf"))
    return logits.probabilities(scores)


# Called with (the layer's position among the layers the runtime cuts, attention module, the last queries
# [B, Hq, w, D], the layer's cached keys and values, query length, the layer's input at those positions [B, w, hidden]).
QueryHook = Callable[[int, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor], None]


@contextlib.contextmanager
def query_hooks(model: nn.Module, callback: QueryHook, window: int = 1) -> Iterator[None]:
    """Call `callback` after every attention layer whose cache grows (`attention_modules`) with its last `window`
    queries, as the model computed them, and its cache."""
    modules = model_layout(model).cut_modules
    positions = {module: position for position, module in enumerate(modules)}

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        with torch.no_grad():
            queries, layer, query_length = hooked_window_queries(module, args, kwargs, window)
            inputs = hooked_input(args, kwargs)[:, -queries.shape[2] :]
            callback(positions[module], module, queries, layer.keys, layer.values, query_length, inputs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(per_layer_attention(model))
        stack.enter_context(capturing_queries(modules, window))
        for module in modules:
            stack.callback(module.register_forward_hook(hook, with_kwargs=True).remove)
        yield
