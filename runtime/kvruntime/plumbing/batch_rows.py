"""A batch of prompts as rows: where each row's own tokens start (left padding), and the rectangular cache that the
rows' compressed caches make together (each row's entries first, zero slots after them up to the layer's longest
row, and which slots attention may see). Pure tensor functions: the engine does the plumbing."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError


def row_starts(attention_mask: torch.Tensor | None, batch: int, length: int) -> list[int]:
    """Where each row's own tokens start in a left-padded batch: `attention_mask` [B, L] holds 1 for a token and 0
    for padding (None: no padding). Refuses padding on the right or inside a prompt, and rows of fewer than 2 tokens
    (nothing to compress)."""
    if attention_mask is None:
        return [0] * batch
    if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch, length):
        raise UnsupportedModelError(
            f"a batch's attention mask must be [batch, tokens] = [{batch}, {length}], got {list(attention_mask.shape)}"
        )
    tokens = attention_mask.bool()
    counts = tokens.sum(dim=1)
    starts = length - counts
    left_padded = torch.arange(length, device=tokens.device)[None, :] >= starts[:, None]
    if not torch.equal(tokens, left_padded):
        raise UnsupportedModelError(
            "padding on the right or inside a prompt: kvruntime takes left-padded batches "
            "(tokenizer.padding_side = 'left'), as transformers' generation does"
        )
    short = [row for row, count in enumerate(counts.tolist()) if count < 2]
    if short:
        raise UnsupportedModelError(
            f"row {short[0]} of the batch holds {int(counts[short[0]])} token(s): every prompt needs at least 2"
        )
    return starts.tolist()


def stack_rows(rows: Sequence[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
    """Rows [1, H, n_b, ...] (one row's cache entries, or their positions [1, H, n_b]) stacked into [B, H, S, ...]:
    each padded after its own entries with `fill` up to the longest row's n_b."""
    slots = max(row.shape[2] for row in rows)
    trailing = rows[0].ndim - 3  # dimensions after the slots (a head dimension for keys and values)
    return torch.cat([F.pad(row, (0, 0) * trailing + (0, slots - row.shape[2]), value=fill) for row in rows])


def stacked_visibility(
    counts: Sequence[int], row_masks: Sequence[torch.Tensor | None], heads: int, device: torch.device
) -> torch.Tensor | None:
    """Which slots of the stacked rows attention may see [B, H, S]: a row's own slots (its `row_masks` [1, H, n_b]
    where it hides some, the `masked` memory mode) and none of the padding after them. None when every slot is
    seen."""
    slots = max(counts)
    own = torch.arange(slots, device=device)[None, :] < torch.tensor(counts, device=device)[:, None]
    visible = own[:, None, :].expand(-1, heads, -1).clone()
    for row, mask in enumerate(row_masks):
        if mask is not None:
            visible[row, :, : mask.shape[-1]] &= mask[0].to(device)
    return None if bool(visible.all()) else visible


def with_appended(
    visible: dict[int, torch.Tensor], slots: Sequence[int], heads: int, appended: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Every layer's visibility [B, H, S + a] once `appended` [B, a] tokens (1 seen, 0 padding: a left-padded
    question) follow the cache of `slots[layer]` slots per row: what attention may see of them, for every query."""
    batch, device = appended.shape[0], appended.device
    masks = {}
    for layer, count in enumerate(slots):
        own = visible.get(layer)
        if own is None:
            own = torch.ones(batch, heads, count, dtype=torch.bool, device=device)
        masks[layer] = torch.cat([own, appended.bool()[:, None, :].expand(-1, heads, -1)], dim=-1)
    return masks


def left_pad(rows: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of several prompts [n_b] as one batch, padded on the left as transformers' generation expects:
    ids [B, L] and attention mask [B, L] (1 for a token, 0 for padding)."""
    longest = max(len(row) for row in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=rows[0].dtype, device=rows[0].device)
    mask = torch.zeros(len(rows), longest, dtype=torch.long, device=rows[0].device)
    for index, row in enumerate(rows):
        ids[index, longest - len(row) :] = row
        mask[index, longest - len(row) :] = 1
    return ids, mask
