"""Model plumbing for CompilerKV's reward: the NLL of a prompt's continuation when each growing layer attends only to
a chosen subset of the prompt's cached entries (or, `loss="kl"`, the KL divergence from the full cache's next-token
distributions along the continuation: the NLL increase's expectation over the continuations the full-cache model
would write, computed over the whole vocabulary instead of one realised token).

One prefill gives the full cache. The model's own forward then runs the continuation once over it
(`prefilled_prompt`), and each decoder layer's call is recorded: its input and the arguments the model gave it (its
position embeddings, whatever its architecture computes). A rollout decodes the continuation teacher-forced over
kept subsets of the cache by calling the decoder layers again with those arguments, so nothing the model does is
rebuilt by hand. A variant whose kept sets first differ from the base's at layer l leaves layers 0..l-1 untouched,
so the base rollout records every layer's input and a batch of variants starts at the first layer any of them
changes. The layers get a cache that hands them the kept entries and never stores the continuation, so one full
cache serves every variant without copies; a sliding-window layer keeps its whole window, as the runtime leaves it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Cache

from kvcompile.recipes.compilerkv.settings import LOSSES
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.attention import KEEP_MASK_KEYWORD, per_layer_attention
from kvruntime.plumbing.cache_ops import cache_argument

# What a decoder layer's recorded call loses before it is replayed: its input, the cache and transformers' mask
# (kvruntime's attention function builds each layer's own).
_REPLACED = {"hidden_states", "attention_mask", "past_key_values", "past_key_value", "cache"}


class KeptEntriesCache:
    """Stands in for a transformers cache during one forward: layer i attends to `prefixes[i]` (keys and values
    [1 or K, Hkv, m, D]) followed by the new tokens, and nothing is stored."""

    def __init__(self, prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.prefixes = prefixes

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple:
        kept_keys, kept_values = self.prefixes[layer_idx]
        batch = keys.shape[0]
        kept_keys = kept_keys.expand(batch, *kept_keys.shape[1:])
        kept_values = kept_values.expand(batch, *kept_values.shape[1:])
        return torch.cat([kept_keys, keys], dim=2), torch.cat([kept_values, values], dim=2)


@dataclasses.dataclass
class PrefilledPrompt:
    """A prompt's full cache (per decoder layer [1, Hkv, N, D]; a sliding-window layer's holds its window), its
    continuation, and the model's own run of the continuation over it: each decoder layer's recorded arguments and
    the first layer's input. `growing` are the decoder indices of the layers whose cache grows, the ones a kept set
    cuts (kept set i for `growing[i]`); `first_nll` is -log p(c_0 | prompt) from the prefill itself, which no
    compression changes; `full_nll` the continuation's mean NLL over the full cache, from the model's own forward."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    growing: tuple[int, ...]
    continuation: torch.Tensor  # [1, c]
    first_nll: float
    first_input: torch.Tensor  # [1, c - 1, hidden]
    layer_arguments: list[dict]
    full_nll: float

    @property
    def length(self) -> int:
        return self.keys[self.growing[0]].shape[2]


@torch.no_grad()
def prefilled_prompt(model: nn.Module, cache: Cache, continuation: torch.Tensor, first_nll: float) -> PrefilledPrompt:
    """Run the continuation [1, c] (but its last token) through the model's own forward over `cache` (a prompt's
    prefilled cache, which this spends: the continuation is appended to it), recording each decoder layer's call."""
    keys = [layer.keys for layer in cache.layers]  # appending replaces these tensors, it does not write into them
    values = [layer.values for layer in cache.layers]
    growing = model_layout(model).cut_layers
    decoder_layers = model_layout(model).decoder_layers
    calls: dict[int, tuple[torch.Tensor, dict]] = {}

    def record(index: int):
        def hook(layer: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            calls[index] = (hidden, {k: v for k, v in kwargs.items() if k not in _REPLACED})

        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(decoder_layers)]
    inputs = continuation[:, :-1]
    length = keys[growing[0]].shape[2]
    positions = torch.arange(length, length + inputs.shape[1], device=inputs.device)[None]
    try:
        with per_layer_attention(model):
            logits = model(inputs, position_ids=positions, **cache_argument(model, cache), use_cache=True).logits
    finally:
        for handle in handles:
            handle.remove()
    return PrefilledPrompt(
        keys=keys,
        values=values,
        growing=growing,
        continuation=continuation,
        first_nll=first_nll,
        first_input=calls[0][0],
        layer_arguments=[calls[i][1] for i in range(len(decoder_layers))],
        full_nll=mean_nll(first_nll, logits[0], continuation[0, 1:]),
    )


@dataclasses.dataclass
class BaseRollout:
    """The continuation run over the base kept sets: its loss (the scorer's: NLL or KL) and what each decoder layer
    received."""

    loss: float
    kept: list[torch.Tensor]
    layer_inputs: list[torch.Tensor]


class ContinuationScorer:
    """Mean token loss of one prompt's continuation over kept subsets of its cache (batch of variants of one
    layer at a time): `nll` (the continuation's negative log-likelihood) or `kl` (see the module). Kept sets are
    position indices [m], one per growing layer, shared by the layer's KV heads."""

    def __init__(self, model: nn.Module, prompt: PrefilledPrompt, batch_size: int = 8, loss: str = "nll") -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r} is none of {', '.join(LOSSES)}")
        self.model = model
        self.prompt = prompt
        self.batch_size = batch_size
        self.layers = model_layout(model).decoder_layers
        self.targets = prompt.continuation[0, 1:]
        # A sliding-window layer attends to its whole window in every rollout.
        self.windows = {
            layer: (prompt.keys[layer], prompt.values[layer])
            for layer in range(len(self.layers))
            if layer not in prompt.growing
        }
        self.reference = None  # kl: the full cache's next-token log-probabilities along the continuation
        if loss == "kl":
            everything = torch.arange(prompt.length)
            prefixes = {layer: self._gather(layer, everything) for layer in prompt.growing}
            with torch.no_grad(), per_layer_attention(model):
                full = self._run_layers(prompt.first_input, 0, prefixes, {})
            self.reference = F.log_softmax(self._logits(full[0]), dim=-1)

    def _gather(self, layer: int, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept entries of one decoder layer for one or more kept sets (positions, on any device): kept [m] ->
        [1, ...], kept [K, m] -> [K, ...]."""
        keys, values = self.prompt.keys[layer][0], self.prompt.values[layer][0]  # [Hkv, N, D]
        rows = (kept if kept.dim() == 2 else kept[None]).to(keys.device)
        return keys[:, rows].transpose(0, 1), values[:, rows].transpose(0, 1)

    def _run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        prefixes: dict[int, tuple],
        masks: dict[int, torch.Tensor],
        record: list | None = None,
    ) -> torch.Tensor:
        """Decoder layers `start`... over `prefixes` (growing layers; the windows are the sliding ones'), each called
        as the model called it; returns the last layer's output after the model's final norm."""
        cache = cache_argument(self.model, KeptEntriesCache({**self.windows, **prefixes}))
        for index in range(start, len(self.layers)):
            if record is not None:
                record.append(hidden)
            extra = {KEEP_MASK_KEYWORD: masks[index]} if index in masks else {}
            arguments = self.prompt.layer_arguments[index]
            output = self.layers[index](hidden, attention_mask=None, **cache, **arguments, **extra)
            hidden = output[0] if isinstance(output, tuple) else output
        return self.model.base_model.norm(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits from final hidden states, as its forward makes them (`ModelLayout.output_logits`)."""
        return model_layout(self.model).output_logits(self.model.get_output_embeddings(), hidden)

    def _losses(self, hidden: torch.Tensor) -> list[float]:
        """Mean loss over the continuation per batch row, the first token's included (its NLL from the prefill; its
        KL is 0: no compression changes the prefill's own prediction)."""
        if self.reference is not None:
            count = self.targets.shape[0] + 1
            return [float(kl_from_reference(self.reference, self._logits(row))) / count for row in hidden]
        return [mean_nll(self.prompt.first_nll, self._logits(row), self.targets) for row in hidden]

    @torch.no_grad()
    def base(self, kept: Sequence[torch.Tensor]) -> BaseRollout:
        prefixes = {layer: self._gather(layer, indices) for layer, indices in zip(self.prompt.growing, kept)}
        inputs: list[torch.Tensor] = []
        with per_layer_attention(self.model):
            hidden = self._run_layers(self.prompt.first_input, 0, prefixes, {}, record=inputs)
        return BaseRollout(loss=self._losses(hidden)[0], kept=list(kept), layer_inputs=inputs)

    @torch.no_grad()
    def variants(self, base: BaseRollout, variants: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        """Loss of each variant: a kept set per growing layer (sizes may differ from the base's). Variants are
        batched by the first layer they change, and each batch starts there from the base rollout's recorded
        input."""
        growing = self.prompt.growing
        first_change = [_first_change(base.kept, variant) for variant in variants]
        if any(layer is None for layer in first_change):
            raise ValueError("a variant keeps what the base keeps: its NLL is the base's")
        order = sorted(range(len(variants)), key=lambda i: first_change[i])
        results: dict[int, float] = {}
        hidden_device = base.layer_inputs[0].device
        with per_layer_attention(self.model):
            for begin in range(0, len(order), self.batch_size):
                batch = order[begin : begin + self.batch_size]
                first = first_change[batch[0]]
                prefixes, masks = {}, {}
                for position in range(first, len(growing)):
                    layer = growing[position]
                    sets = [variants[i][position] for i in batch]
                    if all(torch.equal(k, base.kept[position]) for k in sets):
                        prefixes[layer] = self._gather(layer, base.kept[position])
                        continue
                    longest = max(len(k) for k in sets)
                    padded = torch.stack([F.pad(k, (0, longest - len(k))) for k in sets])  # pad with position 0
                    prefixes[layer] = self._gather(layer, padded)
                    valid = torch.arange(longest)[None] < torch.tensor([len(k) for k in sets])[:, None]
                    if not bool(valid.all()):
                        kv_heads = self.prompt.keys[layer].shape[1]
                        masks[layer] = valid[:, None, :].expand(-1, kv_heads, -1).to(hidden_device)
                start = growing[first]
                hidden = base.layer_inputs[start].expand(len(batch), -1, -1)
                results.update(zip(batch, self._losses(self._run_layers(hidden, start, prefixes, masks))))
        return [results[i] for i in range(len(variants))]


def mean_nll(first_nll: float, logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean NLL over a continuation: its first token's (`first_nll`, from the prefill) and the rest's, predicted by
    `logits` [c - 1, V] of targets [c - 1]."""
    return (first_nll + float(F.cross_entropy(logits.float(), targets, reduction="sum"))) / (targets.shape[0] + 1)


def kl_from_reference(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """sum over positions of KL(p || q): p the reference's distributions (log-probabilities [T, V]), q the softmax
    of `logits` [T, V]."""
    return F.kl_div(F.log_softmax(logits, dim=-1), reference, log_target=True, reduction="sum")


def _first_change(base: Sequence[torch.Tensor], variant: Sequence[torch.Tensor]) -> int | None:
    return next((layer for layer, (b, v) in enumerate(zip(base, variant)) if not torch.equal(b, v)), None)
