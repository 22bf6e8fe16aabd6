"""What `kvcompile compile` runs for some methods, torch-free: the artifact kinds they read, in the order one is
compiled before what reads it, and the one command a refusal names for what a model lacks."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence

from kvruntime import KVRuntimeError

ALL_METHODS = "all"
# The most a whole compile took over its estimate (benchmarks/performance/compile_estimate.md: 1.02-1.24x over three
# probes of the shipped models' records; own_model_compile.md: 1.12x): --minutes fits the estimate times this.
ESTIMATE_MARGIN = 1.25


def kinds_needed(methods: Sequence[str]) -> list[str]:
    """The artifact kinds `methods` read, in the order of `ARTIFACT_KINDS` (one compiled before what reads it);
    refuses an unknown method in one line."""
    from kvruntime import ARTIFACT_KINDS
    from kvruntime.requests.request import required_artifact_kinds

    needed = {kind for method in methods for kind in required_artifact_kinds(method)}
    return [kind for kind in ARTIFACT_KINDS if kind in needed]


def methods_of(text: str) -> list[str]:
    """The methods --methods names ('all': every registered name, aliases included)."""
    from kvruntime.registry import METHOD_NAMES

    if text.strip() == ALL_METHODS:
        return list(METHOD_NAMES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise KVRuntimeError("--methods is empty: name the methods to compile for, or 'all'")
    return names


def compile_hint(model: str, methods: Sequence[str]) -> str:
    """The one command that compiles what `methods` lack for `model`, as a refusal names it."""
    return shlex.join(["kvcompile", "compile", "--model", model, "--methods", ",".join(methods)])


def compile_arguments(kind: str, model: str, settings: object, device: str, dtype: str) -> list[str]:
    """The arguments of the compile command that writes `kind` for `model` at `settings`, resumable."""
    from kvcompile.settings import command_line_arguments
    from kvruntime import ARTIFACT_KINDS

    command = ARTIFACT_KINDS[kind].command.split()[1:]
    return [
        *command,
        "--model",
        model,
        "--resume",
        *command_line_arguments(settings),
        "--device",
        device,
        "--dtype",
        dtype,
    ]


def fitted_scale(seconds_at: Callable[[float], float], budget: float) -> float | None:
    """The largest scale (0-1, to 1%) of the compile settings (`scaled`) whose estimate `seconds_at` fits within
    `budget` seconds; None where even the least settings (scale 0: every count at its floor) do not. The estimate
    grows with the scale, every count being non-decreasing in it."""
    if seconds_at(1.0) <= budget:
        return 1.0
    if seconds_at(0.0) > budget:
        return None
    low, high = 0.0, 1.0
    while high - low > 0.01:
        middle = (low + high) / 2
        low, high = (middle, high) if seconds_at(middle) <= budget else (low, middle)
    return low
