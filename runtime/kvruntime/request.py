"""What a compression request may ask for, checked without torch or a model: method names and the artifacts
they need, memory modes, ratio and budget ranges. The command line refuses bad input with these before it imports
the heavy runtime."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping

from .errors import KVRuntimeError, short_repr

MEMORY_MODES = ("padded", "masked")
ARTIFACT_FREE_NAMES = ("snapkv", "kvcompress")
BUDGETABLE_NAMES = (*ARTIFACT_FREE_NAMES, "srh", "distilled")  # those that take `+budgets` (error-aware layer shares)
DEFAULT_METHOD = "kvcompress"  # what `compress` applies when given no method and no tuned defaults
METHOD_NAMES = ("snapkv", "kvcompress", "srh", "compresskv", "compilerkv", "kvcompose", "distilled")
# The options each method takes: a type (bool, float) or the tuple of its allowed words.
OPTIONS: dict[str, dict[str, object]] = {
    "compilerkv": {"nearest_budget": bool, "uniform_heads": bool, "fixed_threshold": float, "elastic": bool},
    "kvcompose": {"mode": ("compiled", "dynamic"), "unstructured": bool},
    "distilled": {"allocation": ("dynamic", "uniform"), "floor": float},
}
ALIASES = {"compresskv": "srh+budgets"}
# Which artifact kind each name part needs (`artifact_kinds` says what compiles it).
NEEDS = {
    "srh": "srh_heads",
    "budgets": "layer_budgets",
    "compilerkv": "compilerkv_tables",
    "kvcompose": "kvcompose_stats",
    "distilled": "distilled_scorer",
}


def parse_method_name(name: str) -> list[str]:
    """The parts of a method name ('compresskv' -> ['srh', 'budgets']); refuses unknown names."""
    parts = ALIASES.get(name, name).split("+")
    budgetable = parts[0] in BUDGETABLE_NAMES and parts[1:] in ([], ["budgets"])
    if not budgetable and parts not in (["compilerkv"], ["kvcompose"]):
        raise KVRuntimeError(
            f"unknown method {name!r} (available: {', '.join(METHOD_NAMES)}, and <method>+budgets for "
            f"{', '.join(BUDGETABLE_NAMES)})"
        )
    return parts


def required_artifact_kinds(name: str, options: Mapping[str, object] = {}) -> list[str]:
    parts = parse_method_name(name)
    if parts == ["kvcompose"] and options.get("mode") == "dynamic":
        return []
    return [NEEDS[part] for part in parts if part in NEEDS]


@dataclasses.dataclass(frozen=True)
class Request:
    """What a compression asks for: a ratio of cache entries removed or a budget of tokens per layer (exactly one),
    and how per-head counts are stored (`memory`). Checked when made: a bad request never reaches a method."""

    ratio: float | None = None
    budget: int | None = None
    memory: str = "padded"

    def __post_init__(self) -> None:
        check_request(self.ratio, self.budget, self.memory)

    def kept_per_head(self, length: int, window: int) -> int:
        """Entries each (layer, KV head) keeps on average from a prompt of `length` tokens, the window included."""
        return kept_per_head(length, window, self.ratio, self.budget)

    def describe(self) -> str:
        return f"ratio {self.ratio}" if self.ratio is not None else f"budget {self.budget} tokens per layer"


def check_request(ratio: float | None, budget: int | None, memory: str) -> None:
    """Refuse a bad request before any model work: unknown memory mode, a ratio or budget of the wrong type or out
    of range."""
    if memory not in MEMORY_MODES:
        raise KVRuntimeError(f"unknown memory mode {short_repr(memory)} (use one of {', '.join(MEMORY_MODES)})")
    _check_amount(ratio, budget)


def _check_amount(ratio: float | None, budget: int | None) -> None:
    if (ratio is None) == (budget is None):
        raise KVRuntimeError("give exactly one of ratio or budget")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
            raise KVRuntimeError(f"ratio {short_repr(ratio)} is not a number: give the fraction of entries removed")
        if not 0.0 <= ratio < 1.0:
            raise KVRuntimeError(f"ratio {ratio} is outside [0, 1): it is the fraction of cache entries removed")
    else:
        if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
            raise KVRuntimeError(f"budget {short_repr(budget)} is not a whole number of tokens per layer")
        if budget < 1:
            raise KVRuntimeError(f"budget {budget} must be a positive number of tokens per layer")


def kept_per_head(length: int, window: int, ratio: float | None = None, budget: int | None = None) -> int:
    """Average number of entries each (layer, KV head) keeps: from a ratio of entries removed, or a budget of
    tokens per layer (at most the prompt's length). Never fewer than the protected window."""
    _check_amount(ratio, budget)
    if ratio is not None:
        keep = length - math.floor(ratio * length)
    else:
        if budget > length:
            raise KVRuntimeError(
                f"budget {budget} tokens per layer is larger than the prompt ({length} tokens): nothing to compress; "
                "give a smaller budget or a ratio"
            )
        keep = budget
    return min(length, max(keep, min(window, length)))


def check_method_options(name: str, options: Mapping[str, object]) -> dict[str, object]:
    """Refuse options the method does not take, and values of the wrong type; returns them as a dict."""
    base, *suffixes = parse_method_name(name)
    known = OPTIONS.get(base, {})
    if base == "distilled" and suffixes and options:
        raise KVRuntimeError(
            f"{name} takes its layer shares from the layer_budgets artifact: options {sorted(options)} do not apply"
        )
    if options and not known:
        raise KVRuntimeError(f"method {name!r} takes no options (got {sorted(options)})")
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise KVRuntimeError(f"unknown {base} options {unknown} (known: {sorted(known)})")
    for key, value in options.items():
        kind = known[key]
        if kind is bool and not isinstance(value, bool):
            raise KVRuntimeError(f"{base} option {key}={value!r} is not a boolean (write true or false)")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise KVRuntimeError(f"{base} option {key}={value!r} is not a number")
        if isinstance(kind, tuple) and value not in kind:
            raise KVRuntimeError(f"unknown {base} {key} {value!r} (use one of {', '.join(kind)})")
    return dict(options)


def parse_option_pairs(pairs: Iterable[str], where: str = "--option") -> dict[str, object]:
    """`key=value` strings (the command line's) to option values: true/false are booleans, numbers are numbers,
    anything else a word. `check_method_options` then checks them against the method."""
    options: dict[str, object] = {}
    for pair in pairs:
        key, separator, text = pair.partition("=")
        if not separator or not key.strip():
            raise KVRuntimeError(f"{where} {pair!r}: write it as key=value")
        options[key.strip()] = _option_value(text.strip())
    return options


def _option_value(text: str) -> object:
    if text in ("true", "false"):
        return text == "true"
    try:
        return float(text)
    except ValueError:
        return text
