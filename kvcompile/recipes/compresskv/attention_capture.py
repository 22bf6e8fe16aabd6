"""Model plumbing for calibration: attention rows of the newest query during generation, and a layer's output.

Only the rows that are needed are computed (the last query against the cached keys, rebuilt from the layer's
input like the runtime's window attention), never an eager-attention pass over the whole prompt.
"""

from __future__ import annotations

import torch
from torch import nn

from kvruntime.plumbing.attention import captured_logits
from kvruntime.plumbing.window import query_hooks, window_attention


def attention_output(module: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The attention layer's output (after o_proj) for one query over the given keys and values: [B, hidden]."""
    probs = window_attention(query, keys, captured_logits(module))  # [B, Hkv, G, 1, N]
    mixed = torch.einsum("bkgwn,bknd->bkgwd", probs, values.float())
    return module.o_proj(mixed.reshape(query.shape[0], -1).to(values.dtype))


def generate_with_attention_rows(
    model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None
) -> tuple[torch.Tensor, list[int]]:
    """Greedy generation with the full cache, returning the attention rows over the prompt of the query that
    produced each generated token, [steps, layers, query heads, prompt length], and the generated ids."""
    prompt_length = prompt_ids.shape[1]
    rows: dict[int, list[torch.Tensor]] = {}

    def keep_row(
        layer: int, module: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *_: object
    ) -> None:
        probs = window_attention(query, keys, captured_logits(module))[0, :, :, -1, :prompt_length]  # [Hkv, G, N]
        rows.setdefault(layer, []).append(probs.reshape(-1, prompt_length))

    with query_hooks(model, keep_row), torch.no_grad():
        greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
        output = model.generate(prompt_ids, eos_token_id=eos_token_id, pad_token_id=eos_token_id, **greedy)
    generated = output[0, prompt_length:].tolist()
    stacked = torch.stack([torch.stack(rows[layer][: len(generated)]) for layer in sorted(rows)], dim=1)
    return stacked, generated
