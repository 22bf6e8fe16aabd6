"""How much a prompt repeats itself: the share of its 8-grams that occurred earlier in it. The compile stage averages
the distilled scorer's layer shares over the calibration prompts that repeat, and the runtime gives a prompt that
repeats its own floor (`distilled`'s `repeating_floor`): one measure and one threshold for both. Per token, how often
its 8-gram occurs again later (`later_occurrences`): `distilled`'s `copy_penalty`, and the count both come from."""

from __future__ import annotations

import torch

NGRAM = 8
REPEATING_FRACTION = 0.25  # a prompt repeats when this share of its 8-grams occurred earlier in it


def repeated_ngram_fraction(ids: torch.Tensor, n: int = NGRAM) -> float:
    """The share of the `n`-grams of `ids` [N] that occurred earlier in it (0 when `ids` is shorter than `n`)."""
    return repeated_share(later_occurrences(ids, n), n)


def repeated_share(later: torch.Tensor, n: int = NGRAM) -> float:
    """`repeated_ngram_fraction` from the prompt's `later_occurrences` [N]: every occurrence of an n-gram after its
    first counts, so the share is one minus the distinct n-grams (each has one last occurrence) over all."""
    grams = later.numel() - n + 1
    if grams < 1:
        return 0.0
    return 1.0 - int((later[n - 1 :] == 0).sum()) / grams


def repeats(fraction: float) -> bool:
    return fraction >= REPEATING_FRACTION


def later_occurrences(ids: torch.Tensor, n: int = NGRAM) -> torch.Tensor:
    """Per token of `ids` [N], how many times the `n`-gram ending at it occurs again later in `ids` (0 for the first
    n - 1 tokens and for a last copy): read from the prompt's ids, known before the prefill, so a streamed prompt
    gets the counts it has in one piece."""
    counts = torch.zeros(ids.numel(), dtype=torch.long, device=ids.device)
    if ids.numel() < n:
        return counts
    _, group = torch.unique(ids.reshape(-1).unfold(0, n, 1), dim=0, return_inverse=True)
    order = torch.argsort(group, stable=True)  # each n-gram's occurrences together, in the order they came
    sizes = torch.bincount(group)
    last = torch.cumsum(sizes, 0) - 1  # where each n-gram's run ends in `order`
    counts[n - 1 :][order] = last[group[order]] - torch.arange(group.numel(), device=ids.device)
    return counts
