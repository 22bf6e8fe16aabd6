"""Scores of one compressed answer against the full cache's, and summaries over ratios (pure functions).

Accuracy is the answer's score (`TaskPrompt.score`). Fidelity shows degradation before accuracy drops: the KL divergence
of the first answer token's distribution from the full cache's, and greedy agreement, the share of the full
cache's first greedy tokens reproduced before the first difference."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the summaries are read torch-free (a bundle's carried results); the scores get tensors
    import torch

AGREEMENT_TOKENS = 32


def next_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(full || compressed) in nats between the next-token distributions given by two logit vectors."""
    return answer_kl(reference_logits.reshape(1, -1), logits.reshape(1, -1))


def answer_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(full || compressed) in nats at each token of an answer both were teacher-forced on (logits [n, vocab]),
    averaged over its tokens: the first token's KL and what follows, with n times the samples."""
    import torch

    reference = torch.log_softmax(reference_logits.double(), dim=-1)
    compressed = torch.log_softmax(logits.double(), dim=-1)
    return float((reference.exp() * (reference - compressed)).sum(dim=-1).clamp(min=0.0).mean())


def greedy_agreement(reference: Sequence[int], tokens: Sequence[int], count: int = AGREEMENT_TOKENS) -> float:
    """Share of the reference's first `count` greedy tokens matched, position by position, up to the first
    difference (after a difference the two continuations condition on different text)."""
    target = list(reference[:count])
    if not target:
        return 1.0
    matched = 0
    for a, b in zip(target, tokens):
        if a != b:
            break
        matched += 1
    return matched / len(target)


def accuracy_auc(full_accuracy: float, curve: dict[float, float]) -> float:
    """Mean accuracy over [0, largest ratio] of the curve through (0, full accuracy) and (ratio, accuracy) points,
    by the trapezoid rule: 1.0 is a method that never loses anything."""
    points = sorted({0.0: full_accuracy, **curve}.items())
    if len(points) < 2:
        return full_accuracy
    area = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(points, points[1:]))
    return area / points[-1][0]


def within_tolerance(full_accuracy: float, accuracy: float, tolerance: float) -> bool:
    return accuracy >= full_accuracy - tolerance - 1e-9  # 1e-9: accuracies are means of 0/1 scores


def largest_ratio_within(full_accuracy: float, curve: dict[float, float], tolerance: float) -> float | None:
    """The largest ratio such that it and every smaller measured ratio keep accuracy within `tolerance` of the
    full cache (a ratio past a failure is not trusted); None when even the smallest fails."""
    chosen = None
    for ratio in sorted(curve):
        if not within_tolerance(full_accuracy, curve[ratio], tolerance):
            break
        chosen = ratio
    return chosen


def bootstrap_interval(
    values: Sequence[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the mean of `values` over resamples with replacement (seeded: the same values give
    the same interval). For paired differences per prompt: does a difference stand out of the prompts' spread?"""
    array = np.asarray(values, dtype=float)
    means = array[np.random.default_rng(seed).integers(0, len(array), size=(resamples, len(array)))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def grouped(records: list[dict], key: Callable[[dict], tuple]) -> dict[tuple, list[dict]]:
    """Records by `key(record)`, in the order they came."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[key(record)].append(record)
    return groups
