"""A second pass over a prefilled context: a task (the context itself, task-agnostic, or a downstream prompt) fed
right after it in the same cache, and each context token's largest attention from it. KVCompose scores this way
(the runtime's dynamic mode through `PrefillResult.second_pass_attention`, the compile stage's `kvcompile stats`).

The task goes through the model a chunk at a time; after every attention layer whose cache grows the chunk's
queries (as the model computed them, `window.query_hooks`) are attended against the cached keys: the largest
probability any task token gives each context token is kept, and nothing quadratic in the context is held. The
cache is restored as it was afterwards (a sliding-window layer, which the task moved on, included).

Two targets: `attention`, the probability itself (KVCompose, KVzip), and `kvzip_plus` (KVzap, arXiv 2601.07891):
what the token adds to the attending token's residual stream, relative to its size, max_j a_ji / |h_j| x
|W_O^h v_i| (h_j the attention input of the task token j, v_i the context token's value, W_O^h the output
projection's block of query head h), so that a token attended to but carrying little, or attended to by a token
whose state is large, counts less.

Lookahead queries (`lookahead_attention`, compiled into a distilled scorer by `kvcompile distill`): a few learned
input embeddings fed after the context the same way, each context token scored by their mean attention: a
cross-token view at the cost of a few tokens, not of a second pass.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import Cache

from .attention import AttentionLogits, captured_logits
from .cache_ops import cache_argument, restored_after
from .window import query_hooks

TARGETS = ("attention", "kvzip_plus")

QUERY_CHUNK = 256  # task queries whose attention rows are held at once: memory linear in the context, not quadratic


def context_attention_max(
    queries: torch.Tensor,
    keys: torch.Tensor,
    logits: AttentionLogits,
    context_length: int,
    chunk: int = QUERY_CHUNK,
    query_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 14 with Agg_task = max: the largest attention probability any task query gives each context token.

    queries [B, Hq, m, D] are the last m positions of keys [B, Hkv, K, D] (post-RoPE, causal among themselves);
    the context is the first `context_length` keys. Probabilities are normalised over every key a query sees,
    as in the model's own attention, then multiplied by `query_weights` [B, m] when given (KVzip+'s 1 / |h_j|).
    Returns [B, Hq, context_length] in float32.
    """
    best = None
    for start, probabilities in _context_probabilities(queries, keys, logits, context_length, chunk):
        if query_weights is not None:
            stop = start + probabilities.shape[-2]
            probabilities = probabilities * query_weights[:, None, None, start:stop, None].float()
        chunk_best = probabilities.amax(dim=-2)
        best = chunk_best if best is None else torch.maximum(best, chunk_best)
    return best.flatten(1, 2)


def context_attention_mean(
    queries: torch.Tensor, keys: torch.Tensor, logits: AttentionLogits, context_length: int
) -> torch.Tensor:
    """The mean attention probability the task queries give each context token (lookahead queries' scores), with
    `context_attention_max`'s shapes and normalisation: [B, Hq, context_length] in float32."""
    total = sum(p.sum(dim=-2) for _, p in _context_probabilities(queries, keys, logits, context_length, QUERY_CHUNK))
    return (total / queries.shape[2]).flatten(1, 2)


def _context_probabilities(
    queries: torch.Tensor, keys: torch.Tensor, logits: AttentionLogits, context_length: int, chunk: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Per chunk of task queries (its first query's index among them): their attention probabilities over the
    context, [B, Hkv, G, chunk, context_length], normalised over every key each query sees (causal)."""
    batch, num_query_heads, task_length, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    groups = num_query_heads // num_kv_heads
    first = keys.shape[2] - task_length  # absolute position of the first task query
    keys32 = keys.float()
    for start in range(0, task_length, chunk):
        stop = min(start + chunk, task_length)
        # A KV head's query heads as one matrix [B, Hkv, G x chunk, D]: one batched product per KV head, read from
        # the keys as they lie (an einsum copied them first).
        grouped = queries[:, :, start:stop].float().reshape(batch, num_kv_heads, groups * (stop - start), head_dim)
        visible = first + stop  # the chunk's last query sees keys [0, first + stop)
        products = torch.matmul(grouped, keys32[:, :, :visible].transpose(-1, -2))
        scores = logits(products).view(batch, num_kv_heads, groups, stop - start, visible)
        own = first + start  # the keys before the chunk's first query are seen by all of it
        positions = torch.arange(own, visible, device=keys.device)
        scores[..., own:].masked_fill_(positions[None, :] > positions[:, None], float("-inf"))
        yield start, logits.probabilities(scores)[..., :context_length]


def output_norms(values: torch.Tensor, output_weight: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """|W_O^h v_i| for every query head h and token i: values [B, Hkv, N, D] and the output projection's weight
    [hidden, Hq * D] -> [B, Hq, N] in float32 (query head h reads KV head h // (Hq // Hkv))."""
    batch, num_kv_heads, length, head_dim = values.shape
    blocks = output_weight.float().view(-1, num_query_heads, head_dim).transpose(0, 1)  # [Hq, hidden, D]
    grams = blocks.transpose(1, 2) @ blocks  # [Hq, D, D]: |W v|^2 = v^T (W^T W) v
    grouped = values.float().repeat_interleave(num_query_heads // num_kv_heads, dim=1)  # [B, Hq, N, D]
    return torch.einsum("bhnd,hde,bhne->bhn", grouped, grams, grouped).clamp(min=0).sqrt()


def kv_head_max(task_max: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """KVzap's per-KV-head score: the largest of its query heads', [B, Hq, N] -> [B, Hkv, N]."""
    batch, num_query_heads, length = task_max.shape
    return task_max.view(batch, num_kv_heads, num_query_heads // num_kv_heads, length).amax(dim=2)


TASK_CHUNK = 512  # task tokens per forward: bounds the attention scores of the scoring pass (sdpa with a mask)


def task_attention_maxima(
    model: nn.Module,
    cache: Cache,
    task_ids: torch.Tensor,
    context_length: int,
    chunk: int = TASK_CHUNK,
    target: str = "attention",
) -> list[torch.Tensor]:
    """Per layer, [B, Hq, context_length]: each context token's largest `target` score (`TARGETS`) from a token
    of `task_ids` [B, m], fed after the `context_length` tokens held in `cache` (the task-agnostic mode feeds the
    context again). The task goes in `chunk` tokens at a time, so that no attention layer ever holds a (task x
    context) score matrix. The cache holds what it held before on return."""
    if target not in TARGETS:
        raise ValueError(f"unknown second-pass target {target!r} (use one of {', '.join(TARGETS)})")
    maxima: dict[int, torch.Tensor] = {}
    factors: dict[int, torch.Tensor] = {}  # kvzip_plus: |W_O^h v_i|, one factor per context token, after the max

    def keep_maxima(
        layer: int,
        module: nn.Module,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        _: int,
        inputs: torch.Tensor,
    ) -> None:
        weights = inputs.float().norm(dim=-1).reciprocal() if target == "kvzip_plus" else None
        layer_max = context_attention_max(queries, keys, captured_logits(module), context_length, query_weights=weights)
        seen = maxima.get(layer)
        maxima[layer] = layer_max if seen is None else torch.maximum(seen, layer_max)
        if target == "kvzip_plus" and layer not in factors:
            factors[layer] = output_norms(values[:, :, :context_length], module.o_proj.weight, queries.shape[1])

    with restored_after(cache), query_hooks(model, keep_maxima, window=chunk), torch.no_grad():
        for start in range(0, task_ids.shape[1], chunk):
            model.base_model(
                input_ids=task_ids[:, start : start + chunk], **cache_argument(model, cache), use_cache=True
            )
    return [maxima[layer] * factors[layer] if factors else maxima[layer] for layer in sorted(maxima)]


def lookahead_attention(
    model: nn.Module, cache: Cache, embeddings: torch.Tensor, context_length: int
) -> list[torch.Tensor]:
    """Per layer whose cache grows, [B, Hq, context_length]: the mean attention each context token gets from the
    input `embeddings` [n, hidden] (learned lookahead queries) fed right after the `context_length` tokens held in
    `cache`, as if appended to the prompt in its prefill (the prompt's own positions never see them). The cache holds
    what it held before on return: their entries are never kept."""
    means: dict[int, torch.Tensor] = {}

    def keep_means(layer: int, module: nn.Module, queries: torch.Tensor, keys: torch.Tensor, *_: object) -> None:
        means[layer] = context_attention_mean(queries, keys, captured_logits(module), context_length)

    batch = cache.layers[0].keys.shape[0]
    parameter = next(model.parameters())
    appended = embeddings.to(device=parameter.device, dtype=parameter.dtype)[None].expand(batch, -1, -1)
    with restored_after(cache), query_hooks(model, keep_means, window=embeddings.shape[0]), torch.no_grad():
        model.base_model(inputs_embeds=appended, **cache_argument(model, cache), use_cache=True)
    return [means[layer] for layer in sorted(means)]
