"""Bounds a model's declared sizes must keep before anything is allocated: a config's (layers, heads, hidden size,
vocabulary, positions, under any of their names) and a GGUF header's layer count, each a positive integer within what
any real model declares and, together, float32 weights this machine can hold; and a `model_type` the installed
transformers implements. Torch-free: the command line refuses a crafted config in a fraction of a second (a config
of 100k layers otherwise hangs the load for minutes)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from collections.abc import Mapping
from pathlib import Path

from ..errors import UnsupportedModelError, printable, short_repr
from .gguf_header import GGUFHeader

# A config's sizes under each name configs give them (GPT-2's `n_layer`...), each bounded past the largest real
# model's (a crafted config of 100k layers hangs the load) and checked as a positive integer where it is given.
CONFIG_BOUNDS = {
    ("num_hidden_layers", "n_layer", "num_layers"): 1024,
    ("num_attention_heads", "n_head"): 1024,
    ("num_key_value_heads",): 1024,
    ("hidden_size", "n_embd", "d_model"): 1 << 17,
    ("intermediate_size", "n_inner"): 1 << 20,
    ("vocab_size",): 1 << 23,
    ("max_position_embeddings", "n_positions"): 1 << 24,
}
LAYER_BOUND = CONFIG_BOUNDS[("num_hidden_layers", "n_layer", "num_layers")]


def text_config(config: Mapping) -> Mapping:
    """A config's text model part (a multimodal config's `text_config`; the config itself otherwise)."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def check_config_sizes(config: Mapping) -> None:
    """Refuse, before any allocation, a config whose sizes are not positive integers, pass what any real model
    declares (`CONFIG_BOUNDS`: 100k layers would take minutes to build), or whose float32 weights would not fit in this
    machine's memory."""
    text = text_config(config)
    sizes = {}
    for names, bound in CONFIG_BOUNDS.items():
        for key in names:
            value = text.get(key)
            if value is not None and (type(value) is not int or not 1 <= value <= bound):
                raise UnsupportedModelError(
                    f"the model's config gives {key} = {short_repr(value)}: a positive integer of at most {bound:,} "
                    "is needed"
                )
            sizes.setdefault(names[0], value)
            sizes[names[0]] = sizes[names[0]] or value
    hidden, layers, vocab = sizes["hidden_size"], sizes["num_hidden_layers"], sizes["vocab_size"]
    if hidden is None or layers is None or vocab is None:
        return  # transformers' defaults: a real config states them
    inner = sizes["intermediate_size"] or 4 * hidden
    weights = 4 * (2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inner))
    memory = machine_memory()
    if memory is not None and weights > memory:
        raise UnsupportedModelError(
            f"the model's config declares about {weights / 2**30:,.1f} GiB of float32 weights, more than this "
            f"machine's {memory / 2**30:,.1f} GiB of memory"
        )


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_known_model_type(config: Mapping) -> None:
    """Refuse a config whose `model_type` this transformers does not implement, read from its own mapping's source
    (nothing imported): the load would fail late, or look for code of the model's own."""
    model_type = config.get("model_type")
    known = known_model_types()
    if model_type is not None and known and model_type not in known:  # none named: the load decides
        raise UnsupportedModelError(
            f"model type {short_repr(model_type)} is not one this transformers "
            f"({importlib.metadata.version('transformers')}) implements: kvcompile runs no model code of its own"
        )


@functools.cache
def known_model_types() -> frozenset[str]:
    """The model types transformers maps to a config class (`("llama", "LlamaConfig")` in its auto mappings), read
    from its installed source: importing them takes seconds and, in some versions, torch. Empty: unreadable."""
    try:
        installed = importlib.metadata.distribution("transformers")
    except importlib.metadata.PackageNotFoundError:
        return frozenset()
    found: set[str] = set()
    for name in ("configuration_auto.py", "auto_mappings.py"):  # the mapping moved to the second in 5.x
        try:
            source = Path(installed.locate_file(f"transformers/models/auto/{name}")).read_text(encoding="utf-8")
        except OSError:
            continue
        found |= set(re.findall(r'\(\s*"([\w-]+)",\s*"\w+Config"\s*\)', source))
    return frozenset(found)


def check_gguf_sizes(header: GGUFHeader, name: str) -> None:
    """`check_config_sizes` for a GGUF: its layer count bounded before transformers builds the model."""
    layers = header.arch_value("block_count")
    if type(layers) is not int or not 1 <= layers <= LAYER_BOUND:
        raise UnsupportedModelError(
            f"GGUF file {name} gives {short_repr(layers)} layers ({printable(header.architecture)}.block_count): at "
            f"most {LAYER_BOUND:,} are accepted"
        )
