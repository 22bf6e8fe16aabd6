"""Attention that stays correct when layers hold caches of different lengths.

transformers builds one attention mask for all layers from layer 0's cache length. After compression the
layers' lengths differ, and a multi-token query (a question) needs each layer's own causal mask. We register an
attention implementation whose name has no entry in the mask registry, so transformers passes no mask, and the
function builds the right mask per layer from the key length it receives: every cached entry precedes the new
queries in the original sequence, so causality is aligned at the right edge. Entries attention must not see come in
as the keyword `KEEP_MASK_KEYWORD` [B, Hkv, N], injected by the engine (and by the compile stage's rollouts, which
run layers by hand): evicted-but-kept entries (the `masked` memory mode) and a batch's padding (the slots after a
row's own entries, a padded question's padding), since transformers' own padding mask is not passed here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "kvruntime_sdpa"
# The attention keyword of a boolean keep mask [B, Hkv, N_ctx]: False hides a cached entry from every query.
KEEP_MASK_KEYWORD = "kvruntime_keep_mask"


def right_aligned_causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] boolean mask: query i sees every key up to kv_len - q_len + i."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - q_len)


def per_layer_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: object,
    kvruntime_keep_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    # `args`: a caller may pass dropout and scaling by position (kvpress's attention wrapper does), so the keep mask
    # is keyword-only and the rest goes through to sdpa as it came.
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = None
    if kvruntime_keep_mask is not None:
        # [B, Hkv, N_ctx] -> [B, Hq, 1, kv_len]; entries appended after compression are always visible.
        groups = query.shape[1] // key.shape[1]
        keep = kvruntime_keep_mask.repeat_interleave(groups, dim=1)
        appended = torch.ones(*keep.shape[:2], kv_len - keep.shape[-1], dtype=torch.bool, device=keep.device)
        mask = torch.cat([keep, appended], dim=-1)[:, :, None, :]
        if q_len > 1:
            mask = mask & right_aligned_causal_mask(q_len, kv_len, query.device)
    elif q_len > 1 and q_len != kv_len:
        mask = right_aligned_causal_mask(q_len, kv_len, query.device)[None, None]
    # With no mask, sdpa_attention_forward uses is_causal for q_len > 1 (here q_len == kv_len: plain prefill).
    return sdpa_attention_forward(module, query, key, value, mask, *args, **kwargs)


@contextlib.contextmanager
def per_layer_attention(model: nn.Module) -> Iterator[None]:
    """Switch the model to the per-layer attention for the duration of the block, then restore its own."""
    AttentionInterface.register(ATTENTION_NAME, per_layer_sdpa)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
