"""Splitting a cache budget over layers (or heads): pure functions.

`error_aware_budgets` is CompressKV's Algorithm 1 (budgets from per-layer compression error); `apportion` turns
compiled shares (KVCompose's layer allocation) into integer counts with a floor and a ceiling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shares_at_ratio(ratios: Sequence[float], table: torch.Tensor, ratio: float) -> tuple[torch.Tensor, str]:
    """The row of compiled shares `table` [R, ...] (one row per increasing compiled ratio) for `ratio`, and how it
    was had: a compiled row, the linear interpolation of the two rows around it (the rows sum to the same total,
    so the interpolation does too), or outside the grid the nearest end's row."""
    if ratio <= ratios[0] or ratio >= ratios[-1]:
        end = 0 if ratio <= ratios[0] else len(ratios) - 1
        exact = abs(ratios[end] - ratio) < 1e-6
        return table[end], f"{'' if exact else 'nearest '}compiled ratio {ratios[end]:g}"
    grid = torch.tensor(ratios, dtype=torch.float64)
    upper = int(torch.searchsorted(grid, torch.tensor(ratio, dtype=torch.float64)))
    if abs(ratios[upper] - ratio) < 1e-6:
        return table[upper], f"compiled ratio {ratios[upper]:g}"
    lower = upper - 1
    weight = (ratio - ratios[lower]) / (ratios[upper] - ratios[lower])
    shares = (1 - weight) * table[lower] + weight * table[upper]
    return shares, f"interpolated between compiled ratios {ratios[lower]:g} and {ratios[upper]:g}"


def refloored_shares(shares: torch.Tensor, compiled_floor: float, floor: float) -> torch.Tensor:
    """Layer shares [L] compiled by an allocation that gave every layer `compiled_floor` times the average first
    and pooled the rest, as if it had given `floor` instead: the pooled part of each share scaled to what the new
    floor leaves (a share below the compiled floor pools nothing)."""
    layers = shares.numel()
    pooled = (shares.double() - compiled_floor / layers).clamp_min(0)
    if float(pooled.sum()) == 0:
        return torch.full_like(shares, 1 / layers, dtype=torch.float64)
    return floor / layers + (1 - floor) * pooled / pooled.sum()


def error_aware_budgets(
    layer_error: Sequence[float], budget: int, minimum: int = 32, maximum_factor: int = 3, length: int | None = None
) -> list[int]:
    """Split `budget * L` tokens over L layers in proportion to their normalised error.

    Each layer gets `minimum + round(e_l * (total - minimum * L))`, clipped to [minimum, maximum] with maximum =
    maximum_factor * budget, and at most the context `length` when it is given (a layer cannot keep more tokens than
    there are); the clipping and the rounding are then repaired one token at a time (add to the highest-error layer
    below the maximum, remove from the lowest-error layer above the minimum) so that the budgets sum to exactly
    `budget * L`: what a clipped layer cannot use goes to the others.
    """
    errors = [float(e) for e in layer_error]
    if not errors or any(e < 0 for e in errors) or sum(errors) <= 0:
        raise ValueError("layer errors must be non-negative with a positive sum")
    if budget < 1:
        raise ValueError(f"budget {budget} must be positive")
    total_error = sum(errors)
    errors = [e / total_error for e in errors]
    layers = len(errors)
    low = min(minimum, budget)
    high = maximum_factor * budget if length is None else min(maximum_factor * budget, length)
    if budget > high:
        raise ValueError(f"budget {budget} is larger than the context ({length} tokens)")
    total = budget * layers
    budgets = [min(high, max(low, low + round(e * (total - low * layers)))) for e in errors]
    by_error = sorted(range(layers), key=lambda i: (-errors[i], i))
    while sum(budgets) < total:
        budgets[next(i for i in by_error if budgets[i] < high)] += 1
    while sum(budgets) > total:
        budgets[next(i for i in reversed(by_error) if budgets[i] > low)] -= 1
    return budgets


def apportion(shares: torch.Tensor, total: int, low: int, high: int) -> torch.Tensor:
    """Integer counts in [low, high], proportional to `shares` (non-negative), summing to exactly `total`.

    Counts start at the floor of each share of `total`, clipped; then one entry at a time goes to the count furthest
    below its exact share (or comes from the one furthest above it), among those still inside the bounds.
    """
    size = shares.numel()
    if not low * size <= total <= high * size:
        raise ValueError(f"{total} entries cannot be split into {size} counts in [{low}, {high}]")
    weights = shares.double().clamp_min(0).flatten()
    exact = weights / weights.sum() * total if float(weights.sum()) > 0 else torch.full_like(weights, total / size)
    counts = exact.floor().clamp(low, high)
    while int(counts.sum()) != total:
        missing = int(counts.sum()) < total
        gap = torch.where(counts < high if missing else counts > low, exact - counts, torch.nan)
        index = int(gap.nan_to_num(-torch.inf).argmax()) if missing else int(gap.nan_to_num(torch.inf).argmin())
        counts[index] += 1 if missing else -1
    return counts.long().view(shares.shape)
