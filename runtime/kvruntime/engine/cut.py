"""Cutting a prompt's cache to what the method keeps: at the end of the prefill from its selection, inside it one
layer at a time (`cut_layer`, under budgets known in advance, after each chunk of a streamed prompt)."""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import Cache

from ..errors import KVRuntimeError, UnsupportedModelError
from ..math.allocation import apportion
from ..math.merging import ReferenceQueries
from ..math.selection import top_indices, top_mask
from ..methods import LayerInputs, Method, PrefillResult
from ..models.layout import model_layout
from ..plumbing.cache_ops import check_growing_layer, keep_entries
from ..plumbing.second_pass import lookahead_attention, task_attention_maxima
from .state import Cut, HeldEntries, PrefillState


def window_notes(state: PrefillState) -> list[str]:
    """Why the cache held may differ from the request: the report says it rather than hide it."""
    plan = state.plan
    if plan.keep <= plan.asked:
        return []
    return [
        f"window              the last {plan.window} tokens always stay: {plan.keep} kept per layer, not {plan.asked}"
    ]


def cut_cache(
    method: Method, modules: list[nn.Module], cache: Cache, state: PrefillState, prefill: PrefillResult, memory: str
) -> Cut:
    """The growing layers of `cache` (those of the attention `modules`) cut to what the method keeps (done already
    when they were cut inside the prefill)."""
    layers = [cache.layers[module.layer_idx] for module in modules]
    for module, layer in zip(modules, layers):
        check_growing_layer(layer, module.layer_idx)
    if state.budgets is not None:
        return cut_inside_prefill(method, layers, state)
    return cut_after_prefill(method, layers, [module.layer_idx for module in modules], state, prefill, memory)


def cut_after_prefill(
    method: Method, layers: list, layer_ids: list[int], state: PrefillState, prefill: PrefillResult, memory: str
) -> Cut:
    """Cut each of the growing cache `layers` (model layer ids `layer_ids`) to the method's selection from every
    layer's statistics, in `memory` mode."""
    notes = window_notes(state)
    if state.plan.keep >= state.length:
        return Cut(
            [state.length] * len(layers), [state.length * layer.keys.shape[1] for layer in layers], [], {}, notes
        )
    if len(state.statistics) != len(layers):
        raise UnsupportedModelError(f"scored {len(state.statistics)} attention layers but the cache has {len(layers)}")
    selection = method.select([state.statistics[i] for i in range(len(layers))], state.plan, prefill)
    counts = selection.counts
    if int(counts.max()) > state.length:
        raise KVRuntimeError(f"{method.name} selected more entries per head than the context holds")
    if memory == "padded" and bool((counts != counts.amax(dim=1, keepdim=True)).any()):
        # Every head of a layer gets the same number of slots: the layer's share of what the method selected,
        # so that the cache held is the requested size (padding each layer to its largest head count held more).
        shares = apportion(
            counts.sum(dim=1).double(), int(counts.sum()) // counts.shape[1], state.plan.window, state.length
        )
        counts = shares[:, None].expand_as(counts)
        notes.append("padded              each layer's slots are its share of the selection, spread over its KV heads")
    slots, entries, kept, masks = [], [], [], {}
    for index, (layer, scores) in enumerate(zip(layers, selection.scores)):
        slot_count = int(counts[index].max())
        indices = top_indices(scores, slot_count)
        keep_entries(layer, indices, method.merge, state.references.get(index))
        kept.append(indices)
        slots.append(slot_count)
        head_counts = counts[index] if memory == "masked" else torch.full_like(counts[index], slot_count)
        entries.append(int(head_counts.sum()))
        if memory == "masked" and bool((head_counts < slot_count).any()):
            # Slots beyond a head's own count are hidden from attention: the method's exact selection.
            masks[layer_ids[index]] = top_mask(scores.gather(-1, indices), head_counts)
    return Cut(slots, entries, kept, masks, notes + selection.notes)


def cut_inside_prefill(method: Method, layers: list, state: PrefillState) -> Cut:
    """What the layers cut inside the prefill hold (`cut_layer`): slots and entries per layer (every head the same
    count)."""
    if len(state.held) != len(layers):
        raise UnsupportedModelError(f"cut {len(state.held)} attention layers but the cache has {len(layers)}")
    kept = [state.held[i].positions for i in range(len(layers))]
    slots = [int(positions.shape[-1]) for positions in kept]
    entries = [count * layer.keys.shape[1] for count, layer in zip(slots, layers)]
    how = method.budgets_note(state.plan)
    note = f"{method.name:<19} {f'{how}; ' if how else ''}tokens kept per layer {min(slots)}-{max(slots)} of {state.length}"
    return Cut(slots, entries, kept, {}, [*window_notes(state), note])


def cut_layer(method: Method, cache_layer: object, layer: LayerInputs, state: PrefillState) -> None:
    """Keep the layer's best entries under its budget, right after its attention (one chunk of the prompt went
    in: the whole prompt when it is not streamed)."""
    earlier = state.held.get(layer.index)
    if earlier is None:
        scores, carry = method.stream_scores(layer, None, None)
    else:
        scores, carry = method.stream_scores(layer, earlier.scores, earlier.carry)
    fresh = torch.arange(layer.start, layer.start + layer.hidden_states.shape[1], device=scores.device)
    positions = fresh.expand(*scores.shape[:2], -1)
    if earlier is not None:
        positions = torch.cat([earlier.positions, positions], dim=-1)
    if scores.shape[-1] != positions.shape[-1]:
        raise KVRuntimeError(f"{method.name} scored {scores.shape[-1]} entries, the layer holds {positions.shape[-1]}")
    budget = min(state.budgets[layer.index], scores.shape[-1])
    if budget < scores.shape[-1]:
        indices = top_indices(scores, budget)
        keep_entries(cache_layer, indices, method.merge, ReferenceQueries(layer.queries, layer.logits))
        scores, positions = scores.gather(-1, indices), positions.gather(-1, indices)
    state.held[layer.index] = HeldEntries(positions, scores, carry)


def method_prefill(
    model: nn.Module, method_name: str, cache: Cache, state: PrefillState, output: object
) -> PrefillResult:
    """What the method may ask of the prefill when it selects (`methods.PrefillResult`): the prompt, its final hidden
    states, and the prompt fed again after itself in the filled cache, timed as part of the scoring."""

    def second_pass(prefix: tuple[int, ...] = (), target: str = "attention") -> list[torch.Tensor]:
        if state.input_ids is None:
            raise KVRuntimeError(f"{method_name}'s scoring pass feeds the prompt again: give token ids, not embeddings")
        ids = state.input_ids
        prefixed = torch.tensor([prefix], dtype=ids.dtype, device=ids.device).expand(ids.shape[0], -1)
        return task_attention_maxima(model, cache, torch.cat([prefixed, ids], 1), state.length, target=target)

    def lookahead(embeddings: torch.Tensor) -> list[torch.Tensor]:
        if state.lookahead_means:  # fed inside the prefill (`appended.py`)
            return [state.lookahead_means[index] for index in sorted(state.lookahead_means)]
        return lookahead_attention(model, cache, embeddings, state.length)

    return PrefillResult(
        length=state.length,
        num_kv_heads=cache.layers[0].keys.shape[1],
        input_ids=state.input_ids,
        hidden_states=output.last_hidden_state,
        output_logits=functools.partial(model_layout(model).output_logits, model.get_output_embeddings()),
        second_pass_attention=second_pass,
        lookahead_attention=lookahead,
    )
