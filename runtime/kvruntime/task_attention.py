"""Model plumbing for KVCompose's scoring pass: a task fed right after a prefilled context, in the same cache.

The task goes through the model a chunk at a time; after every attention layer the chunk's queries are rebuilt
from the layer's input (as for window attention) and attended against the cached keys: the largest probability
any task token gives each context token is kept, and nothing quadratic in the context is held. The cache is cut
back to the context afterwards.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache

from .cache_ops import truncate
from .composite_tokens import context_attention_max
from .window_attention import query_hooks

TASK_CHUNK = 512  # task tokens per forward: bounds the attention scores of the scoring pass (sdpa with a mask)


def task_attention_maxima(
    model: nn.Module, cache: Cache, task_ids: torch.Tensor, context_length: int, chunk: int = TASK_CHUNK
) -> list[torch.Tensor]:
    """Per layer, [B, Hq, context_length]: each context token's largest attention from a token of `task_ids`
    [B, m], fed after the `context_length` tokens held in `cache` (the task-agnostic mode feeds the context
    again). The task goes in `chunk` tokens at a time, so that no attention layer ever holds a (task x context)
    score matrix. The cache holds only the context again on return."""
    maxima: dict[int, torch.Tensor] = {}

    def keep_maxima(module: nn.Module, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, _: int) -> None:
        layer_max = context_attention_max(queries, keys, module.scaling, context_length)
        seen = maxima.get(module.layer_idx)
        maxima[module.layer_idx] = layer_max if seen is None else torch.maximum(seen, layer_max)

    try:
        with query_hooks(model, keep_maxima, window=chunk), torch.no_grad():
            for start in range(0, task_ids.shape[1], chunk):
                model.base_model(input_ids=task_ids[:, start : start + chunk], past_key_values=cache, use_cache=True)
    finally:
        truncate(cache, context_length)
    return [maxima[layer] for layer in sorted(maxima)]
