"""CompilerKV's compiled operating points, checked without torch: its tables are learned per budget."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from ...artifacts.artifact_header import small_tensor_values
from ...errors import KVRuntimeError
from ...requests.request import Request

UTILITIES = ("global", "head")  # the spec's stabilized utility, or the head-aware one


def _budgets_text(budgets: Sequence[int]) -> str:
    return f"budgets {', '.join(map(str, budgets))}" if len(budgets) > 1 else f"budget {budgets[0]}"


def compiled_budget_index(budgets: Sequence[int], budget: int, nearest: bool = False) -> int:
    """The index of a compiled budget; a budget not compiled is refused unless `nearest` is set."""
    if budget in budgets:
        return list(budgets).index(budget)
    if not nearest:
        raise KVRuntimeError(
            f"compilerkv tables were compiled for {_budgets_text(budgets)} tokens per layer, "
            f"not {budget}: pass {'one of them' if len(budgets) > 1 else 'it'} (--budget), or allow the nearest "
            "compiled budget (nearest_budget=True, --nearest-budget)"
        )
    return min(range(len(budgets)), key=lambda i: (abs(budgets[i] - budget), budgets[i]))


def check_compilerkv_request(budgets: Sequence[int], nearest: bool, request: Request) -> None:
    """The tables are compiled per budget: a budget must be one of them unless the nearest compiled one is allowed.
    A ratio (a budget that depends on the prompt's length) runs the tables of the nearest compiled budget, as every
    method serves a ratio: the entries held are the ratio's, only the tables are the nearest budget's."""
    if request.budget is not None:
        compiled_budget_index(budgets, request.budget, nearest)


def operating_points(artifact: str | os.PathLike, options: Mapping[str, object]) -> Callable[[Request], None]:
    """The check of a request against the budgets compiled into the tables at `artifact` (read once)."""
    budgets = [int(b) for b in small_tensor_values(artifact, "budgets")]
    nearest = bool(options.get("nearest_budget", False))
    return lambda request: check_compilerkv_request(budgets, nearest, request)
