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


def likeness_to_earlier(
    hidden_states: torch.Tensor, start: int = 0, earlier_sum: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, N, hidden] -> [B, N]: cosine of each token's state to the mean state of the tokens before it, the first
    token left out (a sink, unlike everything); 0 for the first two tokens. Causal: a token's value never depends on
    the tokens after it. Text that repeats scores near 1, and a second pass spreads its attention over the copies.
    A prompt streamed in chunks: `start` is the position of the chunk's first token and `earlier_sum` the
    `running_state_sum` of the chunks before it."""
    states = hidden_states.float()
    counted = _counted_states(states, start)
    # The sum of the counted tokens before each token (a zero in front: the first token's sum is empty).
    before = torch.cat([counted.new_zeros(counted.shape[0], 1, counted.shape[2]), counted[:, :-1]], dim=1).cumsum(1)
    if earlier_sum is not None:
        before = before + earlier_sum[:, None]
    cosine = (states * before).sum(dim=-1) / (states.norm(dim=-1) * before.norm(dim=-1)).clamp(min=1e-6)
    positions = torch.arange(start, start + states.shape[1], device=states.device)
    return torch.where(positions >= 2, cosine, torch.zeros_like(cosine))


def running_state_sum(
    hidden_states: torch.Tensor, start: int = 0, earlier_sum: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, hidden]: the sum `likeness_to_earlier` compares the next chunk's tokens with (every token so far but the
    prompt's first), from a chunk starting at `start` and the sum before it."""
    chunk_sum = _counted_states(hidden_states.float(), start).sum(dim=1)
    return chunk_sum if earlier_sum is None else earlier_sum + chunk_sum


def _counted_states(states: torch.Tensor, start: int) -> torch.Tensor:
    """The states with the prompt's first token (position 0, when in this chunk) zeroed: it is left out."""
    if start > 0:
        return states
    return torch.cat([torch.zeros_like(states[:, :1]), states[:, 1:]], dim=1)


def token_features(
    hidden_states: torch.Tensor, start: int = 0, earlier_sum: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, N, hidden] -> [B, N, feature_count(hidden)] in float32 (the fit's sums cast them to float64). A chunk of
    a streamed prompt: `start` and `earlier_sum` as in `likeness_to_earlier`."""
    batch, length, _ = hidden_states.shape
    positions = torch.arange(start, start + length, device=hidden_states.device, dtype=torch.float32)
    extra = torch.stack([torch.ones_like(positions), positions.log1p(), (positions == 0).float()], dim=-1)
    return torch.cat(
        [
            hidden_states.float(),
            extra.expand(batch, length, EXTRA_FEATURES - 1),
            likeness_to_earlier(hidden_states, start, earlier_sum)[..., None],
        ],
        dim=-1,
    )


def predicted_scores(features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One layer's scores per KV head [B, Hkv, N] from its token features [B, N, F] and weights [F, Hkv]."""
    return (features.to(weights.dtype) @ weights).transpose(1, 2)
