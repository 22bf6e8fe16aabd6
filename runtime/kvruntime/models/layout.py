"""What the runtime knows about a loaded model, in one place: which layers it cuts and which it leaves to the model
(sliding-window ones), the attention module of each, its text config, how its final hidden states become logits,
and what it refuses on that model. Built once per model (`model_layout`); every part of the runtime and of the
compile stage reads it rather than the config. Its torch-free counterpart, for the checks made before torch loads,
is `model_spec` (`layer_kinds`, `ModelFacts`).

Two numberings meet here: a method's layer i is the i-th cut layer (`cut_layers[i]`, the model's `layer_idx`);
`cut_position` maps back."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from typing import Any

import torch
from torch import nn

from ..errors import KVRuntimeError, UnsupportedModelError
from ..math.attention_logits import soft_capped
from .model_spec import (
    ATTENTION_FLAGS,
    ATTENTION_REFUSAL,
    BOUNDED,
    GROWING,
    SLIDING_BATCH,
    SLIDING_KV_BITS,
    attention_supported,
    check_layer_kinds,
    language_config,
    loaded_layer_kinds,
    loaded_position_limit,
)

# Built once per loaded model: the attention modules are found by walking the model, its class's source is read.
_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, ModelLayout] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True, eq=False)
class ModelLayout:
    """One loaded model as the runtime sees it. `kinds[i]` is layer i's kind (`GROWING`: full attention, cut by the
    methods; `BOUNDED`: a sliding window the model bounds itself, left to it), `attention[i]` its attention module."""

    model_type: str
    kinds: tuple[str, ...]
    attention: tuple[nn.Module, ...]
    decoder_layers: tuple[nn.Module, ...]  # the decoder stack, layer i's attention inside `decoder_layers[i]`
    text_config: Any
    positions: int | None  # the most positions the model attends over (None: not stated)
    # How the final hidden states (after the last norm) become logits beyond the output embedding: divided by
    # `logits_divisor` (Granite's `logits_scaling`, Cohere's 1 / `logit_scale`), then soft-capped (Gemma 2 and 3).
    logits_divisor: float
    final_softcap: float | None

    @functools.cached_property
    def cut_layers(self) -> tuple[int, ...]:
        """The model's indices of the layers the methods score and cut: a method's layer i is `cut_layers[i]`."""
        return tuple(index for index, kind in enumerate(self.kinds) if kind == GROWING)

    @functools.cached_property
    def sliding_layers(self) -> tuple[int, ...]:
        """The model's indices of its sliding-window layers, which the runtime leaves to the model."""
        return tuple(index for index, kind in enumerate(self.kinds) if kind == BOUNDED)

    @property
    def cut_modules(self) -> list[nn.Module]:
        """The attention modules of the cut layers, in layer order (a method's layer i is the i-th)."""
        return [self.attention[index] for index in self.cut_layers]

    @property
    def sliding_modules(self) -> list[nn.Module]:
        """The attention modules of the sliding-window layers, in layer order."""
        return [self.attention[index] for index in self.sliding_layers]

    def cut_position(self, layer: int) -> int:
        """The method's index of the model's layer `layer` (one of `cut_layers`)."""
        return self.cut_layers.index(layer)

    def output_logits(self, output_embeddings: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """The model's next-token logits from its final hidden states, as its own forward makes them (float32)."""
        logits = output_embeddings(hidden_states).float()
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        return soft_capped(logits, self.final_softcap)

    def check_kv_bits(self, kv_bits: int | None) -> None:
        """Refuse quantized entries on a model with sliding-window layers (`SLIDING_KV_BITS`)."""
        if kv_bits is not None and self.sliding_layers:
            raise KVRuntimeError(SLIDING_KV_BITS)

    def check_unpadded(self) -> None:
        """Refuse a batch or a padded prompt on a model with sliding-window layers: padding shifts their band."""
        if self.sliding_layers:
            raise KVRuntimeError(SLIDING_BATCH)

    def check_every_layer_cut(self, who: str) -> None:
        """Refuse, for a compressor that cuts every layer (kvpress's pipeline), a model with sliding-window ones."""
        if self.sliding_layers:
            raise KVRuntimeError(
                f"{who}: kvpress compresses every layer, sliding-window ones included, and this model has some; "
                "kvruntime.compress cuts its full-attention layers and leaves the sliding ones to the model"
            )


def model_layout(model: nn.Module) -> ModelLayout:
    """The layout of a loaded causal LM (built on first use, then kept with the model). Refuses a model the runtime
    cannot compress: one whose attention does not go through transformers' attention interface as sdpa or with only
    what kvruntime's attention function implements (`attention_supported`), or whose layers are not full-attention
    and sliding-window ones, at least one of them full."""
    layout = _LAYOUTS.get(model)
    if layout is None:
        layout = _LAYOUTS[model] = _built_layout(model)
    return layout


def _built_layout(model: nn.Module) -> ModelLayout:
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    flags = {flag: bool(getattr(model, flag, False)) for flag in ATTENTION_FLAGS}
    if not attention_supported(flags, _class_source(type(model))):
        raise UnsupportedModelError(f"model type {model_type!r} {ATTENTION_REFUSAL}")
    kinds = tuple(check_layer_kinds(loaded_layer_kinds(config), model_type))
    modules = sorted(_self_attention(model), key=lambda module: module.layer_idx)
    if [module.layer_idx for module in modules] != list(range(len(kinds))):
        raise UnsupportedModelError(
            f"{model_type}: found {len(modules)} self-attention modules for {len(kinds)} layers"
        )
    text = language_config(config)
    scale = getattr(text, "logit_scale", None)  # Cohere multiplies its logits by it
    divisor = getattr(text, "logits_scaling", None) or (1.0 / scale if scale else 1.0)  # Granite divides by it
    return ModelLayout(
        model_type=model_type,
        kinds=kinds,
        attention=tuple(modules),
        decoder_layers=tuple(getattr(model.base_model, "layers", ())),
        text_config=text,
        positions=loaded_position_limit(config),
        logits_divisor=float(divisor),
        final_softcap=getattr(text, "final_logit_softcapping", None) or None,
    )


@functools.cache
def _class_source(model_class: type) -> str:
    """The source of the module defining a model class (its attention calls); empty where it cannot be read."""
    try:
        return inspect.getsource(inspect.getmodule(model_class))
    except (OSError, TypeError):
        return ""


def _self_attention(model: nn.Module) -> list[nn.Module]:
    """The attention modules of the decoder layers: those that know their layer (transformers' `layer_idx`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


# A cache layer's kind, read from transformers' cache layers (a sliding one holds at most its window).
def is_window_layer(layer: object) -> bool:
    """Whether a cache layer is a sliding window's (bounded by the model, never cut)."""
    return bool(getattr(layer, "is_sliding", False))


def window_length(layer: object) -> int:
    """The entries a sliding cache layer keeps at most."""
    return int(layer.sliding_window)


def resize_window(layer: object, change: int) -> None:
    """Let a sliding cache layer keep `change` more entries (fewer, negative) from its next update on."""
    layer.sliding_window += change
