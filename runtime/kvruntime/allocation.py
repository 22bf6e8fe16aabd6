"""Per-layer budgets from per-layer compression error: CompressKV's Algorithm 1, a pure function."""

from __future__ import annotations

from collections.abc import Sequence


def error_aware_budgets(
    layer_error: Sequence[float], budget: int, minimum: int = 32, maximum_factor: int = 3
) -> list[int]:
    """Split `budget * L` tokens over L layers in proportion to their normalised error.

    Each layer gets `minimum + round(e_l * (total - minimum * L))`, clipped to [minimum, maximum_factor * budget];
    rounding is then repaired one token at a time (add to the highest-error layer below the maximum, remove from
    the lowest-error layer above the minimum) so that the budgets sum to exactly `budget * L`.
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
    high = maximum_factor * budget
    total = budget * layers
    budgets = [min(high, max(low, low + round(e * (total - low * layers)))) for e in errors]
    by_error = sorted(range(layers), key=lambda i: (-errors[i], i))
    while sum(budgets) < total:
        budgets[next(i for i in by_error if budgets[i] < high)] += 1
    while sum(budgets) > total:
        budgets[next(i for i in reversed(by_error) if budgets[i] > low)] -= 1
    return budgets
