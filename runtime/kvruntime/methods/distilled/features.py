"""What the distilled scorer reads of each token, the same at compile time and at run time: the attention layer's
input (after its input norm), the token's position (log scale), whether it is the first token (attention sinks are
first tokens), how alike it is to the tokens before it (repeated text), and a bias. Pure functions, no model."""

from __future__ import annotations

import torch

EXTRA_FEATURES = 4  # bias, log1p(position), first token, likeness to the earlier tokens


def feature_count(hidden_size: int) -> int:
    """How many features a token has for a model of this hidden size (a scorer's weights have one row each)."""
    return hidden_size + EXTRA_FEATURES


def student_features(hidden_size: int, student: str) -> torch.Tensor:
    """The indices of the features a student reads (the others keep weight 0): `all`, or `hidden`, KVzap's student
    (the attention input and the bias only: a plain linear map of the hidden state, exportable to kvpress's
    KVzapModel)."""
    if student == "all":
        return torch.arange(feature_count(hidden_size))
    return torch.arange(hidden_size + 1)  # the bias is the first extra feature


# Tokens per block of `dots_with_earlier`: its Gram matrices cost the block's size per token, its running sum one row
# per block.
LIKENESS_BLOCK = 32


def likeness_to_earlier(
    hidden_states: torch.Tensor, start: int = 0, earlier_sum: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, N, hidden] -> [B, N]: cosine of each token's state to the mean state of the tokens before it, the first
    token left out (a sink, unlike everything); 0 for the first two tokens. Causal: a token's value never depends on
    the tokens after it. Text that repeats scores near 1, and a second pass spreads its attention over the copies.
    A prompt streamed in chunks: `start` is the position of the chunk's first token and `earlier_sum` the
    `running_state_sum` of the chunks before it."""
    # It runs inside every layer's prefill: no [B, N, hidden] running sum is built (allocating one per layer cost
    # more than the arithmetic). The dot products come from `dots_with_earlier`, and the sum's norm from them:
    # |S + s|^2 = |S|^2 + 2 s.S + |s|^2, accumulated in float64 (float32 where the device has none: MPS).
    states = hidden_states.float()
    accumulated = torch.float32 if states.device.type == "mps" else torch.float64
    offset = torch.zeros_like(states[:, 0]) if earlier_sum is None else earlier_sum.float()
    if start == 0:
        offset = offset - states[:, 0]  # the prompt's first token is left out (position 0 itself is masked below)
    dots, squares = dots_with_earlier(states, offset, LIKENESS_BLOCK)
    steps = (2 * dots + squares).to(accumulated)
    if start == 0:
        steps[:, 0] = 0  # the first token is left out: the second token's earlier sum is `earlier_sum` alone
    earlier_norms = steps.cumsum(1) - steps  # squared
    if earlier_sum is not None:
        earlier_norms += earlier_sum.to(accumulated).square().sum(-1, keepdim=True)
    cosine = dots / (squares.sqrt() * earlier_norms.clamp(min=0).sqrt().float()).clamp(min=1e-6)
    positions = torch.arange(start, start + states.shape[1], device=states.device)
    return torch.where(positions >= 2, cosine, torch.zeros_like(cosine))


def dots_with_earlier(states: torch.Tensor, offset: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N, hidden] and [B, hidden] -> [B, N] twice: each token's dot product with `offset` plus the sum of the
    tokens before it, and its squared norm. Per `block` tokens: the earlier blocks through their running sum (one
    row per block), the earlier tokens of its own block and the norms through the block's Gram matrix."""
    batch, length, hidden = states.shape
    whole = length - length % block
    pieces = [states[:, :whole].reshape(batch, -1, block, hidden), states[:, None, whole:]]  # the blocks, the rest
    dots, squares, before = [], [], offset
    for blocks in (piece for piece in pieces if piece.shape[1] * piece.shape[2]):
        sums = blocks.sum(2)
        running = sums.cumsum(1).add_(before[:, None])  # each block's sum and every token before it
        gram = torch.matmul(blocks, blocks.transpose(-1, -2))
        squares.append(gram.diagonal(dim1=-2, dim2=-1).flatten(1))
        earlier = torch.matmul(blocks, (running - sums)[..., None]).squeeze(-1)
        dots.append(gram.tril(-1).sum(-1).add_(earlier).flatten(1))
        before = running[:, -1]
    return torch.cat(dots, dim=1), torch.cat(squares, dim=1)


def running_state_sum(
    hidden_states: torch.Tensor, start: int = 0, earlier_sum: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, hidden]: the sum `likeness_to_earlier` compares the next chunk's tokens with (every token so far but the
    prompt's first), from a chunk starting at `start` and the sum before it."""
    states = hidden_states.float()
    chunk_sum = states.sum(dim=1) if start > 0 else states[:, 1:].sum(dim=1)
    return chunk_sum if earlier_sum is None else earlier_sum + chunk_sum


def extra_features(
    hidden_states: torch.Tensor, start: int = 0, earlier_sum: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, N, hidden] -> [B, N, EXTRA_FEATURES] in float32: the features after the attention input, in their order."""
    batch, length, _ = hidden_states.shape
    positions = torch.arange(start, start + length, device=hidden_states.device, dtype=torch.float32)
    fixed = torch.stack([torch.ones_like(positions), positions.log1p(), (positions == 0).float()], dim=-1)
    likeness = likeness_to_earlier(hidden_states, start, earlier_sum)[..., None]
    return torch.cat([fixed.expand(batch, length, EXTRA_FEATURES - 1), likeness], dim=-1)


def token_features(
    hidden_states: torch.Tensor, start: int = 0, earlier_sum: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, N, hidden] -> [B, N, feature_count(hidden)] in float32 (the fit's sums cast them to float64). A chunk of
    a streamed prompt: `start` and `earlier_sum` as in `likeness_to_earlier`."""
    return torch.cat([hidden_states.float(), extra_features(hidden_states, start, earlier_sum)], dim=-1)


def predicted_scores(features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One layer's scores per KV head [B, Hkv, N] from its token features [B, N, F] and weights [F, Hkv]."""
    return (features.to(weights.dtype) @ weights).transpose(1, 2)


def predicted_token_scores(
    hidden_states: torch.Tensor, weights: torch.Tensor, start: int = 0, earlier_sum: torch.Tensor | None = None
) -> torch.Tensor:
    """`predicted_scores(token_features(...), weights)` without building the features: the attention input's part
    of the product and the extra features' part, summed (no copy of the hidden states inside the prefill)."""
    hidden = hidden_states.shape[-1]
    from_hidden = torch.nn.functional.linear(hidden_states.to(weights.dtype), weights[:hidden].T.contiguous())
    from_extra = extra_features(hidden_states, start, earlier_sum).to(weights.dtype) @ weights[hidden:]
    return (from_hidden + from_extra).transpose(1, 2)
