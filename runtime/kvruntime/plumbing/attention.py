"""Attention that stays correct when layers hold caches of different lengths, and that hands the methods the
queries the model computed.

transformers builds one attention mask for all layers from layer 0's cache length. After compression the
layers' lengths differ, and a multi-token query (a question) needs each layer's own causal mask. We register an
attention implementation whose name has no entry in the mask registry, so transformers passes no mask, and the
function builds the right mask per layer from the key length it receives: every cached entry precedes the new
queries in the original sequence, so causality is aligned at the right edge. A sliding-window layer (the model
passes its `sliding_window`) is never cut: its keys are the last positions in order, so its band is aligned at the
right edge too. Entries attention must not see come in as the keyword `KEEP_MASK_KEYWORD` [B, Hkv, N], injected by
the engine (and by the compile stage's rollouts, which call the decoder layers themselves): evicted-but-kept entries
(the `masked` memory mode) and a batch's padding (the slots after a row's own entries, a padded question's padding),
since transformers' own padding mask is not passed here.

The queries a scoring method reads are the ones this function receives, after the model's own projections, norms,
RoPE and whatever else its architecture does: an attention module given a `QueryCapture` (`capturing_queries`)
keeps its last queries there, with how the model turns a query-key product into a logit (`AttentionLogits`: the
scaling it passed, and the soft cap of a model that caps its logits, Gemma 2). Nothing is rebuilt by hand, so any
decoder transformers runs through its attention interface is scored on what it computes. A soft-capped model's
attention, and one with learned attention sinks (gpt-oss: a logit per query head that takes part in the softmax and
attends to nothing), is computed here in full (sdpa does neither), with the same masks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..math.attention_logits import AttentionLogits, right_aligned_causal_mask

ATTENTION_NAME = "kvruntime_attention"  # no "sdpa" in it: transformers would check the model supports sdpa
# The attention keyword of a boolean keep mask [B, Hkv, N_ctx]: False hides a cached entry from every query.
KEEP_MASK_KEYWORD = "kvruntime_keep_mask"


# Attribute of an attention module while its queries are captured (`capturing_queries`).
_CAPTURE = "_kvruntime_query_capture"


@dataclasses.dataclass
class QueryCapture:
    """The last `window` queries [B, Hq, w, D] an attention module computed in its latest call (None before one),
    and how it made them into logits."""

    window: int
    queries: torch.Tensor | None = None
    logits: AttentionLogits | None = None


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
    scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
    sinks = kwargs.pop("s_aux", None)  # gpt-oss's attention sinks [Hq]
    default_scaling = query.shape[-1] ** -0.5
    logits = AttentionLogits(default_scaling if scaling is None else scaling, kwargs.pop("softcap", None), sinks)
    capture = getattr(module, _CAPTURE, None)
    if capture is not None:
        # A copy when it is a part: a view would hold the layer's whole query tensor (the prompt's length of queries,
        # 4.7 MB per layer of the default model at 2k tokens) alive until the layer's next call.
        captured = query[:, :, -capture.window :]
        capture.queries, capture.logits = captured.clone() if captured.shape[2] < query.shape[2] else captured, logits
    q_len, kv_len = query.shape[-2], key.shape[-2]
    window = kwargs.get("sliding_window")
    window = window if window is not None and kv_len > window else None  # a band that hides nothing is no band
    mask = None
    if kvruntime_keep_mask is not None:
        # [B, Hkv, N_ctx] -> [B, Hq, 1, kv_len]; entries appended after compression are always visible.
        groups = query.shape[1] // key.shape[1]
        keep = kvruntime_keep_mask.repeat_interleave(groups, dim=1)
        appended = torch.ones(*keep.shape[:2], kv_len - keep.shape[-1], dtype=torch.bool, device=keep.device)
        mask = torch.cat([keep, appended], dim=-1)[:, :, None, :]
        if q_len > 1 or window is not None:
            mask = mask & right_aligned_causal_mask(q_len, kv_len, query.device, window)
    elif (q_len > 1 and q_len != kv_len) or window is not None:
        mask = right_aligned_causal_mask(q_len, kv_len, query.device, window)[None, None]
    if logits.softcap is not None or sinks is not None:
        if mask is None and q_len > 1:
            mask = right_aligned_causal_mask(q_len, kv_len, query.device)[None, None]
        return explicit_attention(query, key, value, mask, logits), None
    # With no mask, sdpa_attention_forward uses is_causal for q_len > 1 (here q_len == kv_len: plain prefill).
    return sdpa_attention_forward(module, query, key, value, mask, *args, **kwargs)


def explicit_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, logits: AttentionLogits
) -> torch.Tensor:
    """Attention with soft-capped logits or attention sinks (what sdpa cannot do), in float32 for the softmax:
    query [B, Hq, q, D], key and value [B, Hkv, N, D], mask boolean (broadcast to [B, Hq, q, N]) -> output
    [B, q, Hq, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = logits(torch.matmul(query, key.transpose(2, 3))).float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    batch, heads, rows, length = scores.shape
    grouped = scores.view(batch, heads // groups, groups, rows, length)  # as `probabilities` reads heads
    weights = logits.probabilities(grouped).view(batch, heads, rows, length)
    return torch.matmul(weights.to(value.dtype), value).transpose(1, 2).contiguous()


@contextlib.contextmanager
def capturing_queries(modules: Sequence[nn.Module], window: int) -> Iterator[list[QueryCapture]]:
    """Inside the block (and `per_layer_attention`), each of `modules` keeps the last `window` queries of its
    latest call in its `QueryCapture` (`captured_queries`); the captures of an enclosing block are back after it."""
    captures = [QueryCapture(window) for _ in modules]
    outer = [getattr(module, _CAPTURE, None) for module in modules]  # a second pass inside a compressed prefill
    for module, capture in zip(modules, captures):
        setattr(module, _CAPTURE, capture)
    try:
        yield captures
    finally:
        for module, capture in zip(modules, outer):
            if capture is None:
                delattr(module, _CAPTURE)
            else:
                setattr(module, _CAPTURE, capture)


def captured_logits(module: nn.Module) -> AttentionLogits:
    """How the module's latest call made its queries into logits (`capturing_queries` must be around it)."""
    capture = getattr(module, _CAPTURE, None)
    if capture is None or capture.logits is None:
        raise RuntimeError(f"no attention call captured for {type(module).__name__}")
    return capture.logits


def captured_queries(module: nn.Module, window: int) -> torch.Tensor:
    """The last `window` queries of the module's latest call (`capturing_queries` must be around it)."""
    capture = getattr(module, _CAPTURE, None)
    if capture is None or capture.queries is None:
        raise RuntimeError(
            f"no queries captured for {type(module).__name__} {getattr(module, 'layer_idx', '?')}: its attention did "
            "not run through kvruntime's attention function (per_layer_attention, capturing_queries)"
        )
    if window > capture.window:
        raise RuntimeError(f"{window} queries asked, {capture.window} captured")
    return capture.queries[:, :, -window:]


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
