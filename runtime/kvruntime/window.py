"""Observation-window attention, recomputed for the last `window` queries only.

The scoring methods need the attention of the prompt's last few queries over all its keys. Switching the model to
eager attention would materialise N x N weights in every layer (3.3x slower at 4k tokens on the default model);
instead the window's queries are rebuilt from the layer's input hidden states (projection, optional q-norm, RoPE)
and attended against the layer's cached keys, which transformers stores after RoPE.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .cache_ops import attention_modules, hooked_cache


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def window_queries(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    window: int,
) -> torch.Tensor:
    """Post-RoPE queries of the last `window` positions: [batch, query heads, window, head_dim]."""
    batch = hidden_states.shape[0]
    head_dim = attention.head_dim
    queries = attention.q_proj(hidden_states[:, -window:]).view(
        batch, -1, attention.config.num_attention_heads, head_dim
    )
    if hasattr(attention, "q_norm"):  # Qwen3-style per-head norm before RoPE
        queries = attention.q_norm(queries)
    queries = queries.transpose(1, 2)
    cos, sin = (t[:, -window:].unsqueeze(1) for t in position_embeddings)
    return queries * cos + _rotate_half(queries) * sin


def hooked_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states an attention module was called with (its input, after the layer's input norm)."""
    return kwargs.get("hidden_states", args[0] if args else None)


def hooked_window_queries(
    attention: nn.Module, args: tuple, kwargs: dict, window: int
) -> tuple[torch.Tensor, object, int]:
    """From a forward hook's call of an attention module: the post-RoPE queries of the last `window` positions
    (at most the query length), the layer's cache layer (keys and values already updated), and the query length."""
    hidden_states = hooked_input(args, kwargs)
    cache_layer = hooked_cache(kwargs).layers[attention.layer_idx]
    query_length = hidden_states.shape[1]
    queries = window_queries(attention, hidden_states, kwargs["position_embeddings"], min(window, query_length))
    return queries, cache_layer, query_length


def window_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention of the window's queries over all keys, in float32, causal inside the window.

    queries [B, Hq, w, D], keys [B, Hkv, N, D] -> probabilities [B, Hkv, Hq // Hkv, w, N]
    (query head h belongs to KV head h // (Hq // Hkv), as in transformers' repeat_kv).
    """
    batch, num_query_heads, window, head_dim = queries.shape
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    grouped = queries.float().view(batch, num_kv_heads, num_query_heads // num_kv_heads, window, head_dim)
    logits = torch.einsum("bkgwd,bknd->bkgwn", grouped, keys.float()) * scaling
    future = torch.ones(window, window, dtype=torch.bool, device=keys.device).triu(diagonal=1)
    logits[..., length - window :].masked_fill_(future, float("-inf"))
    return logits.softmax(dim=-1)


# Called with (attention module, the last queries [B, Hq, w, D], the layer's cached keys and values, query length,
# the layer's input at those positions [B, w, hidden]).
QueryHook = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor], None]


@contextlib.contextmanager
def query_hooks(model: nn.Module, callback: QueryHook, window: int = 1) -> Iterator[None]:
    """Call `callback` after every attention layer with its last `window` queries (post-RoPE) and its cache."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        with torch.no_grad():
            queries, layer, query_length = hooked_window_queries(module, args, kwargs, window)
            inputs = hooked_input(args, kwargs)[:, -queries.shape[2] :]
            callback(module, queries, layer.keys, layer.values, query_length, inputs)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
