"""Model plumbing for calibration: hooks that see each attention layer's newest query during generation.

Only the rows that are needed are computed (the last query against the cached keys, rebuilt from the layer's
input like the runtime's window attention), never an eager-attention pass over the whole prompt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from kvruntime.cache_ops import attention_modules
from kvruntime.window_attention import hooked_window_queries, window_attention

# Called with (attention module, the last queries [B, Hq, w, D], the layer's cached keys and values, query length).
QueryHook = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, int], None]


@contextlib.contextmanager
def query_hooks(model: nn.Module, callback: QueryHook, window: int = 1) -> Iterator[None]:
    """Call `callback` after every attention layer with its last `window` queries (post-RoPE) and its cache."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        with torch.no_grad():
            queries, layer, query_length = hooked_window_queries(module, args, kwargs, window)
            callback(module, queries, layer.keys, layer.values, query_length)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def attention_output(module: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The attention layer's output (after o_proj) for one query over the given keys and values: [B, hidden]."""
    probs = window_attention(query, keys, module.scaling)  # [B, Hkv, G, 1, N]
    mixed = torch.einsum("bkgwn,bknd->bkgwd", probs, values.float())
    return module.o_proj(mixed.reshape(query.shape[0], -1).to(values.dtype))


def generate_with_attention_rows(
    model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None
) -> tuple[torch.Tensor, list[int]]:
    """Greedy generation with the full cache, returning the attention rows over the prompt of the query that
    produced each generated token, [steps, layers, query heads, prompt length], and the generated ids."""
    prompt_length = prompt_ids.shape[1]
    rows: dict[int, list[torch.Tensor]] = {}

    def keep_row(module: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, _: int) -> None:
        probs = window_attention(query, keys, module.scaling)[0, :, :, -1, :prompt_length]  # [Hkv, G, N]
        rows.setdefault(module.layer_idx, []).append(probs.reshape(-1, prompt_length))

    with query_hooks(model, keep_row), torch.no_grad():
        output = model.generate(
            prompt_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    generated = output[0, prompt_length:].tolist()
    stacked = torch.stack([torch.stack(rows[layer][: len(generated)]) for layer in sorted(rows)], dim=1)
    return stacked, generated
