"""Model plumbing for CompilerKV's reward: the NLL of a prompt's continuation when each layer attends only to a
chosen subset of the prompt's cached entries (or, `loss="kl"`, the KL divergence from the full cache's next-token
distributions along the continuation: the NLL increase's expectation over the continuations the full-cache model
would write, computed over the whole vocabulary instead of one realised token).

One prefill gives the full cache. A rollout decodes the continuation teacher-forced over kept subsets of it. A
variant whose kept sets first differ from the base's at layer l leaves layers 0..l-1 untouched, so the base rollout
records every layer's input and a batch of variants starts at the first layer any of them changes.
Decoder layers are called directly with a cache that hands them the kept entries and never stores the
continuation, so one full cache serves every variant without copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvcompile.recipes.compilerkv.settings import LOSSES
from kvruntime.attention import KEEP_MASK_KEYWORD, per_layer_attention
from kvruntime.cache_ops import cache_argument


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
    """A prompt's full cache (per layer [1, Hkv, N, D]) and its continuation; `first_nll` is -log p(c_0 | prompt)
    from the prefill itself, which no compression changes."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    continuation: torch.Tensor  # [1, c]
    first_nll: float

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


@dataclasses.dataclass
class BaseRollout:
    """The continuation run over the base kept sets: its loss (the scorer's: NLL or KL) and what each layer
    received."""

    loss: float
    kept: list[torch.Tensor]
    layer_inputs: list[torch.Tensor]


class ContinuationScorer:
    """Mean token loss of one prompt's continuation over kept subsets of its cache (batch of variants of one
    layer at a time): `nll` (the continuation's negative log-likelihood) or `kl` (see the module). Kept sets are
    position indices [m], one per layer, shared by the layer's KV heads."""

    def __init__(self, model: nn.Module, prompt: PrefilledPrompt, batch_size: int = 8, loss: str = "nll") -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r} is none of {', '.join(LOSSES)}")
        self.model = model
        self.prompt = prompt
        self.batch_size = batch_size
        base = model.base_model
        self.layers = list(base.layers)
        inputs = prompt.continuation[:, :-1]
        positions = torch.arange(prompt.length, prompt.length + inputs.shape[1], device=inputs.device)[None]
        self.embedded = base.embed_tokens(inputs)
        self.position_ids = positions
        self.position_embeddings = base.rotary_emb(self.embedded, positions)
        self.targets = prompt.continuation[0, 1:]
        self.reference = None  # kl: the full cache's next-token log-probabilities along the continuation
        if loss == "kl":
            everything = torch.arange(prompt.length)
            prefixes = {layer: self._gather(layer, everything) for layer in range(len(self.layers))}
            with torch.no_grad(), per_layer_attention(model):
                full = self._run_layers(self.embedded, 0, prefixes, {})
            self.reference = F.log_softmax(model.get_output_embeddings()(full[0]).float(), dim=-1)

    def _gather(self, layer: int, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept entries of one layer for one or more kept sets (positions, on any device): kept [m] -> [1, ...],
        kept [K, m] -> [K, ...]."""
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
        cache = KeptEntriesCache(prefixes)
        for index in range(start, len(self.layers)):
            if record is not None:
                record.append(hidden)
            extra = {KEEP_MASK_KEYWORD: masks[index]} if index in masks else {}
            output = self.layers[index](
                hidden,
                attention_mask=None,
                position_ids=self.position_ids,
                **cache_argument(self.model, cache),
                use_cache=True,
                position_embeddings=self.position_embeddings,
                **extra,
            )
            hidden = output[0] if isinstance(output, tuple) else output
        return self.model.base_model.norm(hidden)

    def _losses(self, hidden: torch.Tensor) -> list[float]:
        """Mean loss over the continuation per batch row, the first token's included (its NLL from the prefill; its
        KL is 0: no compression changes the prefill's own prediction)."""
        head = self.model.get_output_embeddings()
        count = self.targets.shape[0] + 1
        if self.reference is not None:
            return [float(kl_from_reference(self.reference, head(row).float())) / count for row in hidden]
        return [
            (self.prompt.first_nll + float(F.cross_entropy(head(row).float(), self.targets, reduction="sum"))) / count
            for row in hidden
        ]

    @torch.no_grad()
    def base(self, kept: Sequence[torch.Tensor]) -> BaseRollout:
        prefixes = {layer: self._gather(layer, indices) for layer, indices in enumerate(kept)}
        inputs: list[torch.Tensor] = []
        with per_layer_attention(self.model):
            hidden = self._run_layers(self.embedded, 0, prefixes, {}, record=inputs)
        return BaseRollout(loss=self._losses(hidden)[0], kept=list(kept), layer_inputs=inputs)

    @torch.no_grad()
    def variants(self, base: BaseRollout, variants: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        """NLL of each variant: a kept set per layer (sizes may differ from the base's). Variants are batched by
        the first layer they change, and each batch starts there from the base rollout's recorded input."""
        first_change = [_first_change(base.kept, variant) for variant in variants]
        if any(layer is None for layer in first_change):
            raise ValueError("a variant keeps what the base keeps: its NLL is the base's")
        order = sorted(range(len(variants)), key=lambda i: first_change[i])
        results: dict[int, float] = {}
        hidden_device = base.layer_inputs[0].device
        with per_layer_attention(self.model):
            for begin in range(0, len(order), self.batch_size):
                batch = order[begin : begin + self.batch_size]
                start = first_change[batch[0]]
                prefixes, masks = {}, {}
                for layer in range(start, len(self.layers)):
                    sets = [variants[i][layer] for i in batch]
                    if all(torch.equal(k, base.kept[layer]) for k in sets):
                        prefixes[layer] = self._gather(layer, base.kept[layer])
                        continue
                    longest = max(len(k) for k in sets)
                    padded = torch.stack([F.pad(k, (0, longest - len(k))) for k in sets])  # pad with position 0
                    prefixes[layer] = self._gather(layer, padded)
                    valid = torch.arange(longest)[None] < torch.tensor([len(k) for k in sets])[:, None]
                    if not bool(valid.all()):
                        kv_heads = self.prompt.keys[layer].shape[1]
                        masks[layer] = valid[:, None, :].expand(-1, kv_heads, -1).to(hidden_device)
                hidden = base.layer_inputs[start].expand(len(batch), -1, -1)
                results.update(zip(batch, self._losses(self._run_layers(hidden, start, prefixes, masks))))
        return [results[i] for i in range(len(variants))]


def kl_from_reference(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """sum over positions of KL(p || q): p the reference's distributions (log-probabilities [T, V]), q the softmax
    of `logits` [T, V]."""
    return F.kl_div(F.log_softmax(logits, dim=-1), reference, log_target=True, reduction="sum")


def _first_change(base: Sequence[torch.Tensor], variant: Sequence[torch.Tensor]) -> int | None:
    return next((layer for layer, (b, v) in enumerate(zip(base, variant)) if not torch.equal(b, v)), None)
