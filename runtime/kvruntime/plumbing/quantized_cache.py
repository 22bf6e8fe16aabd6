"""A compressed cache quantized for decoding (`compress(..., kv_bits=...)`): once the prefill is cut, each layer's
kept entries move into a transformers quantized cache layer, which the answer's tokens then join. 8 bits: FP8 with
one scale per tensor (transformers' own `fp8` backend, no other package); 4 bits: optimum-quanto's int4, group-wise
with a full-precision residual of recent tokens (KIVI's layout, transformers' `quanto` backend). The selection
itself always reads full-precision keys (the prefill's); only what is held afterwards is quantized.

HQQ (transformers' `hqq` backend) is not wired: its sdist builds CUDA kernels when installed unless DISABLE_CUDA=1,
and brings accelerate, einops and termcolor; installed that way it quantizes on the CPU here (docs/usage.md)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from ..errors import KVRuntimeError

if TYPE_CHECKING:  # torch-free to import: the command line checks kv_bits before torch loads
    from transformers import Cache

KV_BITS = {8: "fp8 (transformers)", 4: "int4 (optimum-quanto)"}


def check_kv_bits(bits: int | None) -> None:
    """Refuse a bit width the runtime does not quantize to, or 4 bits without optimum-quanto, in one line (torch
    is not imported)."""
    if bits is None:
        return
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise KVRuntimeError(f"kv_bits={bits!r}: give one of {', '.join(map(str, KV_BITS))} (or none)")
    if bits == 4 and not _installed("optimum.quanto"):
        raise KVRuntimeError("kv_bits=4 needs optimum-quanto: pip install 'kvruntime[quant]' (or kv_bits=8, built in)")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def quantized_layer(bits: int, head_dim: int = 64) -> object:
    """An empty transformers quantized cache layer of `bits` (`KV_BITS`); int4 groups of one head's vector of one
    token (`head_dim` values: quanto's group must divide every length the layer will hold)."""
    from transformers import cache_utils

    if bits == 4:
        return cache_utils.QuantoQuantizedLayer(nbits=4, q_group_size=head_dim)
    if not hasattr(cache_utils, "Fp8QuantizedLayer"):  # added to transformers after 5.2
        raise KVRuntimeError("kv_bits=8 needs transformers' FP8 cache layers (a newer transformers): upgrade it")
    return cache_utils.Fp8QuantizedLayer()


def quantize_cache(cache: Cache, bits: int) -> None:
    """Move each layer's entries into a quantized layer of `bits`, in place (the cache object stays: keep masks and
    positions recorded for it still apply)."""
    for index, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            continue
        quantized = quantized_layer(bits, layer.keys.shape[-1])
        quantized.update(layer.keys, layer.values)
        cache.layers[index] = quantized


def held_bytes(value: object) -> int:
    """Bytes a tensor holds (its whole storage: a view over a larger buffer is not counted as freed), a quantized
    tensor's parts (packed data, scales, shifts: through
    `__tensor_flatten__`), or a tuple of them (FP8's tensor and scale)."""
    import torch

    if isinstance(value, tuple | list):
        return sum(held_bytes(part) for part in value)
    if not isinstance(value, torch.Tensor):
        return 0
    if type(value) is torch.Tensor or not hasattr(value, "__tensor_flatten__"):
        return value.untyped_storage().nbytes()
    names, _ = value.__tensor_flatten__()
    return sum(held_bytes(getattr(value, name)) for name in names)


def layer_bytes(layer: object) -> int:
    """Bytes a cache layer holds: its keys and values, and a quantized layer's quantized states besides (its keys
    and values are then the full-precision residual)."""
    parts = [
        layer.keys,
        layer.values,
        getattr(layer, "_quantized_keys", None),
        getattr(layer, "_quantized_values", None),
    ]
    return sum(held_bytes(part) for part in parts)
