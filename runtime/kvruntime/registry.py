"""The runtime's methods, each registered once in its own folder: `methods/<name>/spec.py` declares a `SPEC`
(`MethodSpec`), `methods/<name>/method.py` builds the method (`build(artifact, options)`). Everything that lists
methods (names and aliases, options, the artifacts they need, windows, whether they stream, the command line's help,
`eval`'s and `tune`'s defaults, the docs' table) reads it from here. Torch-free: the command line refuses bad input
with it before importing torch.

A method `<name>+error-aware` is the method with CompressKV's error-aware layer budgets (a `layer_budgets` artifact),
for the methods that declare `error_aware`; `<name>+budgets` is its spelling before issue #65, still read (eval records
and tuned defaults name it).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from .errors import KVRuntimeError

ERROR_AWARE = "error-aware"  # the name suffix: CompressKV's error-aware layer budgets
SUFFIXES = (ERROR_AWARE, "budgets")  # the suffix as written now, then before issue #65
DEFAULT_METHOD = "kvcompress"  # what `compress` applies when given no method and no tuned defaults
# What a saved context is compressed with when no method is named: the most faithful measured per model and text
# type, level with or ahead of its two-pass teacher but on repeated text (docs/usage.md).
SAVED_CONTEXT_METHOD = "distilled"
LAYER_BUDGETS_KIND = "layer_budgets"  # the artifact they come from
MERGES = ("off", "values", "refit")  # every method's `merge` option (`kvruntime.math.merging`)


def _always(options: Mapping[str, object]) -> bool:
    return True


def _either_memory(options: Mapping[str, object]) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Option:
    """One method option: its type (bool, float) or the tuple of its allowed words, its default, what it does, and
    for a number the range it takes (checked once, by `request.check_method_options`)."""

    kind: type | tuple[str, ...]  # bool, int, float, or the allowed words
    default: object
    help: str
    minimum: float | None = None  # the least value a number takes (an int: 1 unless given)
    maximum: float | None = None  # the largest value a number takes

    @property
    def least(self) -> float:
        return self.minimum if self.minimum is not None else (1 if self.kind is int else -math.inf)

    @property
    def most(self) -> float:
        return self.maximum if self.maximum is not None else math.inf


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    name: str  # the folder's name, and the method's on the command line
    summary: str  # one line: what it does (help, docs table)
    window: int  # the protected recent window, in tokens: the default of every method's `window` option
    options: Mapping[str, Option] = dataclasses.field(default_factory=dict)  # the method dataclass's public fields
    needs: str | None = None  # the artifact kind it applies (`artifact_kinds`)
    needs_artifact: Callable[[Mapping[str, object]], bool] = _always  # with these options (kvcompose dynamic: no)
    streams: Callable[[Mapping[str, object]], bool] = _always  # layer budgets known before any layer's scores
    memory: Callable[[Mapping[str, object]], str | None] = _either_memory  # the memory mode these options need
    error_aware: bool = False  # takes `+error-aware`
    options_with_error_aware: bool = True  # whether its options still apply with `+error-aware`
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)  # other names: alias -> full name
    compared: tuple[str, ...] | None = None  # what `eval` and `tune` compare by default (None: the name)
    # its folder's operating_points.py checks a request against the operating points compiled into its artifact
    # (budgets, ratios), from the artifact's header alone (`operating_point_check`); False: it serves any request
    operating_points: bool = False

    @property
    def all_options(self) -> dict[str, Option]:
        """Its options, with the `window` (issue #33: the rule around the scores matters) and the `merge` (issue
        #74: what becomes of the entries it evicts) every method takes."""
        window = Option(int, self.window, "the most recent tokens, always kept")
        merge = Option(
            MERGES,
            "off",
            "values: each evicted value folded into the kept entry whose key is most alike; refit: the kept values "
            "fitted so that the prompt's last queries read what the whole prompt gave them",
        )
        return {"window": window, "merge": merge, **self.options}

    @property
    def compared_names(self) -> tuple[str, ...]:
        return (self.name,) if self.compared is None else self.compared


class RegisteredFacts:
    """What a method's registration declares of it (`MethodSpec.streams`, `.memory`), read from its own option
    values: the facts are declared once, in the spec, and the built method answers from them."""

    spec: MethodSpec

    def option_values(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.spec.all_options}

    @property
    def budgets_known_in_advance(self) -> bool:
        return self.spec.streams(self.option_values())

    def required_memory(self) -> str | None:
        return self.spec.memory(self.option_values())


def option_fields(spec: MethodSpec) -> type:
    """A dataclass whose fields are the method's options (`window` included), each with its declared default, and
    whose facts are the registration's (`RegisteredFacts`): the base of the method's own dataclass, so that an option
    and a fact are declared once, in its registration, and the method reads an option as `self.<option>`."""
    fields = []
    for name, option in spec.all_options.items():
        kind = str if isinstance(option.kind, tuple) else option.kind
        fields.append(
            (name, kind if option.default is not None else kind | None, dataclasses.field(default=option.default))
        )
    return dataclasses.make_dataclass(
        f"{spec.name.title()}Options", fields, bases=(RegisteredFacts,), namespace={"spec": spec}
    )


def discover(folder: Path, package: str) -> dict[str, MethodSpec]:
    """The SPEC of every method folder under `folder` (a subpackage `package.<name>` with a `spec.py`)."""
    specs = {}
    for entry in sorted(folder.iterdir()):
        if not (entry / "spec.py").is_file():
            continue
        spec = importlib.import_module(f"{package}.{entry.name}.spec").SPEC
        if spec.name != entry.name:
            raise RuntimeError(f"method folder {entry.name} registers {spec.name!r}: a method's name is its folder's")
        specs[spec.name] = spec
    return specs


METHODS: dict[str, MethodSpec] = discover(Path(__file__).with_name("methods"), f"{__package__}.methods")
ALIASES: dict[str, str] = {alias: full for spec in METHODS.values() for alias, full in spec.aliases.items()}
METHOD_NAMES: tuple[str, ...] = tuple(sorted([*METHODS, *ALIASES]))
ERROR_AWARE_NAMES: tuple[str, ...] = tuple(name for name, spec in METHODS.items() if spec.error_aware)
COMPARED_NAMES: tuple[str, ...] = tuple(name for spec in METHODS.values() for name in spec.compared_names)


def registration_of(name: str) -> MethodSpec | None:
    """The registration a method name (an alias, a `+error-aware` name) belongs to; None for a name not registered."""
    return METHODS.get(ALIASES.get(name, name).partition("+")[0])


def method_spec(name: str) -> tuple[MethodSpec, bool]:
    """The registration of a method name and whether it asks for error-aware layer budgets; refuses unknown names
    ('compresskv' -> srh's, True)."""
    _, plus, suffix = ALIASES.get(name, name).partition("+")
    spec = registration_of(name)
    if spec is None or (plus and (suffix not in SUFFIXES or not spec.error_aware)):
        raise KVRuntimeError(
            f"unknown method {name!r} (available: {', '.join(METHOD_NAMES)}, and <method>+{ERROR_AWARE} for "
            f"{', '.join(ERROR_AWARE_NAMES)})"
        )
    return spec, bool(plus)


def operating_point_check(
    spec: MethodSpec, artifact: str | os.PathLike, options: Mapping[str, object]
) -> Callable[[object], None] | None:
    """The check of a request (`request.Request`) against the operating points compiled into the method's
    `artifact`, read once (its `operating_points.py`); None for a method that serves any request."""
    if not spec.operating_points:
        return None
    module = importlib.import_module(f"{__package__}.methods.{spec.name}.operating_points")
    return module.operating_points(artifact, options)


def canonical_name(name: str) -> str:
    """The name a method goes by in reports: its alias where it has one ('srh+error-aware' -> 'compresskv'), the
    suffix as written now ('snapkv+budgets' -> 'snapkv+error-aware')."""
    spec, error_aware = method_spec(name)
    full = f"{spec.name}+{ERROR_AWARE}" if error_aware else spec.name
    return next((alias for alias, target in spec.aliases.items() if target == full), full)


def methods_help() -> str:
    """The methods in one line, for the command line's help."""
    names = ", ".join(ERROR_AWARE_NAMES)
    return f"{', '.join(METHOD_NAMES)}; <method>+{ERROR_AWARE} for {names} (error-aware layer budgets)"


def methods_table() -> str:
    """The docs' table of methods (README.md, between its methods markers)."""
    rows = ["| method | what it does | needs | docs |", "| --- | --- | --- | --- |"]
    for spec in METHODS.values():
        needs = f"`{spec.needs}`" if spec.needs else "nothing"
        error_aware = [alias for alias, full in spec.aliases.items() if "+" in full]
        if error_aware:  # an alias for the method with error-aware layer budgets reads them too
            needs += f"; `{', '.join(error_aware)}` also `{LAYER_BUDGETS_KIND}`"
        names = ", ".join(f"`{n}`" for n in (spec.name, *spec.aliases))
        rows.append(f"| {names} | {spec.summary} | {needs} | [docs](docs/methods/{spec.name}.md) |")
    return "\n".join(rows)
