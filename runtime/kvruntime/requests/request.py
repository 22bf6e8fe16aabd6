"""What a compression request may ask for, checked without torch or a model: the artifacts and options of a method
(from its registration, `registry`), memory modes, ratio and budget ranges. The command line refuses bad input with
these before it imports the heavy runtime."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import KVRuntimeError, short_repr
from ..registry import LAYER_BUDGETS_KIND, Option, method_spec

MEMORY_MODES = ("padded", "masked")


def required_artifact_kinds(name: str, options: Mapping[str, object] = {}) -> list[str]:
    """The artifact kinds method `name` applies with these options (its own, then `+error-aware`' layer_budgets)."""
    spec, budgets = method_spec(name)
    kinds = [spec.needs] if spec.needs and spec.needs_artifact(options) else []
    return kinds + ([LAYER_BUDGETS_KIND] if budgets else [])


@dataclasses.dataclass(frozen=True)
class Request:
    """What a compression asks for: a ratio of cache entries removed or a budget of tokens per layer (exactly one),
    and how per-head counts are stored (`memory`). Checked when made: a bad request never reaches a method."""

    ratio: float | None = None
    budget: int | None = None
    memory: str = "padded"

    def __post_init__(self) -> None:
        check_request(self.ratio, self.budget, self.memory)

    def plan(self, length: int, window: int, input_ids: Any = None) -> KeepPlan:
        """What a prompt of `length` tokens (`input_ids` [N], when its ids are known) keeps under this request, for a
        method protecting `window` tokens. A window longer than the prompt would keep it whole whatever the request
        says: refused, as a budget is."""
        if window > length:
            raise KVRuntimeError(
                f"the method's window of {window} recent tokens is longer than the prompt ({length} tokens): nothing "
                "to compress; give a smaller window (option window) or a longer prompt"
            )
        keep = kept_per_head(length, window, self.ratio, self.budget)
        return KeepPlan(self, length, window, keep, kept_per_head(length, 1, self.ratio, self.budget), input_ids)

    def describe(self) -> str:
        return f"ratio {self.ratio}" if self.ratio is not None else f"budget {self.budget} tokens per layer"


@dataclasses.dataclass(frozen=True)
class KeepPlan:
    """What one prefill keeps, decided once from the request, the prompt and the method's window; every method and
    the engine read it rather than derive it again."""

    request: Request
    length: int  # the prompt's tokens
    window: int  # the recent tokens that always stay (the method's window, at most the prompt)
    keep: int  # entries each (layer, KV head) keeps on average, the window included
    asked: int  # what the request alone asks for: more is kept when the window outgrows it
    # The prompt's token ids [N] (a tensor), None when it came as embeddings: what `repeated` counts.
    input_ids: Any = dataclasses.field(default=None, compare=False, repr=False)

    @functools.cached_property
    def repeated(self) -> float | None:
        """The share of the prompt's 8-grams seen earlier in it (`math/repetition.py`), None without its ids: counted when
        a method asks (0.2 s for 128k tokens on a CPU), once per prompt, from the same count as `later_occurrences`."""
        if self.later_occurrences is None:
            return None
        from ..math.repetition import repeated_share  # torch: this module stays importable without it

        return repeated_share(self.later_occurrences)

    @functools.cached_property
    def later_occurrences(self) -> Any:
        """Per token [N], how often the 8-gram ending at it occurs again later in the prompt (`math/repetition.py`), None
        without its ids: counted when a method asks, once per prompt."""
        if self.input_ids is None:
            return None
        from ..math.repetition import later_occurrences

        return later_occurrences(self.input_ids)

    @property
    def ratio(self) -> float:
        """The share of the prompt's entries removed: the request's ratio, or its budget's share of this prompt."""
        return self.request.ratio if self.request.ratio is not None else 1.0 - self.keep / self.length


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


class CheckedOptions(dict):
    """A method's options as `check_method_options` returned them: checked once at a request's edge, then trusted by
    every later step of it (the serving checks, the method's build). Read-only: a changed copy is a plain dict, and
    is checked again."""

    def __init__(self, method: str, values: Mapping[str, object]) -> None:
        super().__init__(values)
        self.method = method

    def __reduce__(self) -> tuple[type, tuple[str, dict[str, object]]]:  # a copy or a pickle, checked as it was
        return CheckedOptions, (self.method, dict(self))

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("checked method options are read-only: copy them into a dict to change them")

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = __ior__ = _refuse  # type: ignore[assignment]


def check_method_options(name: str, options: Mapping[str, object]) -> CheckedOptions:
    """Refuse options the method does not take, and values of the wrong type; returns them checked (options this
    function returned for the same method come back as they are)."""
    if isinstance(options, CheckedOptions) and options.method == name:
        return options
    spec, budgets = method_spec(name)
    known = spec.all_options
    if budgets and not spec.options_with_error_aware:
        known = {key: known[key] for key in ("window", "merge")}
        if set(options) - set(known):
            raise KVRuntimeError(
                f"{name} takes its layer shares from the layer_budgets artifact: options "
                f"{sorted(set(options) - set(known))} do not apply"
            )
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise KVRuntimeError(f"unknown {spec.name} options {unknown} (known: {sorted(known)})")
    return CheckedOptions(
        name, {key: check_option_value(spec.name, key, known[key], value) for key, value in options.items()}
    )


def check_option_value(method: str, key: str, option: Option, value: object) -> object:
    """Refuse a value of the wrong type or outside the option's range (a number that is not finite included);
    returns it as the method takes it (the command line reads numbers as floats)."""
    kind = option.kind
    if value is None and option.default is None:  # an option whose default is "not set" (the artifact's own rule)
        return value
    if kind is bool and not isinstance(value, bool):
        raise KVRuntimeError(f"{method} option {key}={short_repr(value)} is not a boolean (write true or false)")
    if isinstance(kind, tuple) and value not in kind:
        raise KVRuntimeError(f"unknown {method} {key} {short_repr(value)} (use one of {', '.join(kind)})")
    if kind not in (int, float):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise KVRuntimeError(f"{method} option {key}={short_repr(value)} is not a number")
    if not math.isfinite(value):
        raise KVRuntimeError(f"{method} option {key}={value} is not finite: give a number")
    if kind is int and not float(value).is_integer():
        raise KVRuntimeError(f"{method} option {key}={short_repr(value)} is not a whole number")
    if not option.least <= value <= option.most:
        bounds = f"at least {option.least}" if option.most == math.inf else f"in [{option.least}, {option.most}]"
        raise KVRuntimeError(f"{method} option {key}={value}: give a value {bounds}")
    return int(value) if kind is int else float(value)


def parse_option_pairs(pairs: Iterable[str], method: str | None = None, where: str = "--option") -> dict[str, object]:
    """`key=value` strings (the command line's) to option values, each in the type `method` declares for it: a
    boolean from true or false, an int from a whole number, a float from a number, a word as written. A key the
    method does not declare (or with no method), or text that is not of its type, stays as written: the caller's own
    keys are the caller's to read, and `check_method_options` refuses the rest by name. A key given twice is
    refused (which value was meant is not for us to guess)."""
    declared = method_spec(method)[0].all_options if method is not None else {}
    options: dict[str, object] = {}
    for pair in pairs:
        key, separator, text = (part.strip() for part in pair.partition("="))
        if not separator or not key:
            raise KVRuntimeError(f"{where} {short_repr(pair)}: write it as key=value")
        if key in options:
            raise KVRuntimeError(f"{where} {short_repr(key)} is given twice: give each option once")
        options[key] = typed_value(declared[key].kind, text) if key in declared else text
    return options


def typed_value(kind: type | tuple[str, ...], text: str) -> object:
    """`text` as a value of an option's `kind`, or as written when it is not one (for the check to refuse)."""
    if kind is bool:
        return {"true": True, "false": False}.get(text, text)
    if kind not in (int, float):
        return text
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if kind is int and value.is_integer() else value
