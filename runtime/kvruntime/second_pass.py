"""A second pass over a prefilled context: a task (the context itself, task-agnostic, or a downstream prompt) fed
right after it in the same cache, and each context token's largest attention from it. KVCompose scores this way
(the runtime's dynamic mode through `Prefill.second_pass_attention`, the compile stage's `kvcompile stats`).

The task goes through the model a chunk at a time; after every attention layer the chunk's queries are rebuilt
from the layer's input (as for window attention) and attended against the cached keys: the largest probability
any task token gives each context token is kept, and nothing quadratic in the context is held. The cache is cut
back to the context afterwards.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache

from .cache_ops import cache_argument, truncate
from .window import query_hooks

QUERY_CHUNK = 256  # task queries whose attention rows are held at once: memory linear in the context, not quadratic


def context_attention_max(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, context_length: int, chunk: int = QUERY_CHUNK
) -> torch.Tensor:
    """Eq. 14 with Agg_task = max: the largest attention probability any task query gives each context token.

    queries [B, Hq, m, D] are the last m positions of keys [B, Hkv, K, D] (post-RoPE, causal among themselves);
    the context is the first `context_length` keys. Probabilities are normalised over every key a query sees,
    as in the model's own attention. Returns [B, Hq, context_length] in float32.
    """
    batch, num_query_heads, task_length, head_dim = queries.shape
    num_kv_heads, key_length = keys.shape[1], keys.shape[2]
    groups = num_query_heads // num_kv_heads
    first = key_length - task_length  # absolute position of the first task query
    keys32 = keys.float()
    best = torch.zeros(batch, num_kv_heads, groups, context_length, device=keys.device)
    for start in range(0, task_length, chunk):
        stop = min(start + chunk, task_length)
        grouped = queries[:, :, start:stop].float().view(batch, num_kv_heads, groups, stop - start, head_dim)
        visible = first + stop  # the chunk's last query sees keys [0, first + stop)
        logits = torch.einsum("bkgwd,bknd->bkgwn", grouped, keys32[:, :, :visible]) * scaling
        positions = torch.arange(first + start, first + stop, device=keys.device)
        future = torch.arange(visible, device=keys.device)[None, :] > positions[:, None]
        logits.masked_fill_(future, float("-inf"))
        probabilities = logits.softmax(dim=-1)[..., :context_length]
        best = torch.maximum(best, probabilities.amax(dim=-2))
    return best.view(batch, num_query_heads, context_length)


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
                model.base_model(
                    input_ids=task_ids[:, start : start + chunk], **cache_argument(model, cache), use_cache=True
                )
    finally:
        truncate(cache, context_length)
    return [maxima[layer] for layer in sorted(maxima)]
