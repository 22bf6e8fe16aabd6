"""Learned lookahead queries fed inside the prompt's own prefill: their input embeddings go after the prompt's in
the same forward, each attention layer's hook takes their attention over the prompt and drops their entries (a
sliding layer stores as many more for that forward), and the output is handed back without them. One forward
instead of a second one of n tokens, whose cost on a CPU is reading every weight again (about 6% of a 2k-token
prefill on the default model)."""

from __future__ import annotations

import torch
from torch import nn

from ..models.layout import resize_window
from ..plumbing.attention import captured_logits
from ..plumbing.second_pass import context_attention_mean
from .state import PrefillState


def widen_window(layer: object, count: int) -> None:
    """A sliding cache layer about to take a prompt and `count` appended positions: it keeps `count` more entries
    this once, so that once they are dropped (`narrow_window`) it holds the prompt's own window. The attention's
    band is the model's (its mask), not the layer's: only what the layer stores changes."""
    resize_window(layer, count)


def narrow_window(layer: object, count: int) -> None:
    """After `widen_window` and the attention: the appended positions' `count` entries dropped, the window back."""
    resize_window(layer, -count)
    layer.keys, layer.values = layer.keys[:, :, :-count], layer.values[:, :, :-count]
    layer.cumulative_length -= count


def appended_inputs(model: nn.Module, kwargs: dict, tokens_key: str, state: PrefillState) -> dict:
    """The base model's arguments for one unpadded prompt [1, N] with the input embeddings `state.lookahead` [n,
    hidden] after it (their count set in `state`): the prompt as embeddings (the model's own input embedding,
    scaling included), its positions and cache positions extended over the n appended positions. Unchanged without
    embeddings, or where the caller's mask is not a plain [1, N] one (a 4D mask says what each position sees: it is
    left as it is)."""
    mask, embeddings = kwargs.get("attention_mask"), state.lookahead
    if embeddings is None or (mask is not None and not (isinstance(mask, torch.Tensor) and mask.ndim == 2)):
        return kwargs
    tokens = kwargs[tokens_key]
    prompt = model.get_input_embeddings()(tokens) if tokens_key == "input_ids" else tokens
    appended = embeddings.to(device=prompt.device, dtype=prompt.dtype)[None].expand(prompt.shape[0], -1, -1)
    count = state.appended = embeddings.shape[0]
    # A one-row prompt's plain mask is all ones (a padded row goes through `rows.py`): causal alone says the same.
    arguments = {key: value for key, value in kwargs.items() if key not in ("input_ids", "attention_mask")}
    arguments["inputs_embeds"] = torch.cat([prompt, appended], dim=1)
    for key in ("position_ids", "cache_position"):
        positions = kwargs.get(key)
        if isinstance(positions, torch.Tensor):
            following = positions[..., -1:] + torch.arange(1, count + 1, device=positions.device)
            arguments[key] = torch.cat([positions, following.to(positions.dtype)], dim=-1)
    return arguments


def without_appended(output: object, length: int) -> object:
    """The base model's `output` as the prompt's `length` positions alone gave it: the appended positions' final
    hidden states (and per-layer ones, when asked for) dropped."""
    output.last_hidden_state = output.last_hidden_state[:, :length]
    states = getattr(output, "hidden_states", None)
    if states is not None:
        output.hidden_states = tuple(state[:, :length] for state in states)
    return output


def prompt_part(
    state: PrefillState,
    index: int,
    module: nn.Module,
    queries: torch.Tensor,
    cache_layer: object,
    hidden_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In an attention layer's hook of a prefill with appended positions: their mean attention over the prompt kept
    in `state` (under the layer's index `index` among the cut ones), their entries dropped from the growing
    `cache_layer` (a view: the cut that follows keeps a copy of what it keeps); returns the prompt's own captured
    `queries` [B, Hq, w, D] (those captured end with the appended ones) and `hidden_states` [B, N, hidden]."""
    appended = queries[:, :, -state.appended :]
    means = context_attention_mean(appended, cache_layer.keys, captured_logits(module), state.length)
    state.lookahead_means[index] = means
    cache_layer.keys = cache_layer.keys[:, :, : state.length]
    cache_layer.values = cache_layer.values[:, :, : state.length]
    return queries[:, :, : -state.appended], hidden_states[:, : state.length]
