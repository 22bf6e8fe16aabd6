"""A compression request resolved once: the method (as named, or as a tuned default names it), its options checked
in their declared types, every request it will serve, its artifacts and how the prefill goes, with the serving checks
run once on it. From files, without torch: the checks read the artifacts' headers. The method is built once, from
artifacts read once, when the engine first asks for it; `compress`, `kvcompile generate`, `eval` and `tune` take the
resolved request as it is and check nothing again."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..artifacts.artifact_header import artifact_file_name, header_kind, header_params, headers_read_once
from ..artifacts.bundle import artifact_files
from ..artifacts.tuned_defaults import TunedDefaults
from ..errors import KVRuntimeError
from ..plumbing.quantized_cache import check_kv_bits
from ..registry import DEFAULT_METHOD, METHODS, registration_of
from ..requests.request import CheckedOptions, Request, check_method_options, required_artifact_kinds
from ..requests.serving import check_serves

if TYPE_CHECKING:
    from ..artifacts.artifact import Artifact
    from . import Method

TUNED_DEFAULTS = "tuned_defaults"


class MissingArtifacts(KVRuntimeError):
    """A method named without artifacts needs kinds that none of the model's artifact folders holds."""

    def __init__(self, method: str, kinds: list[str]) -> None:
        super().__init__(f"method {method!r} needs {' and '.join(kinds)}, which this model has not got")
        self.method, self.kinds = method, kinds


@dataclasses.dataclass(frozen=True)
class ResolvedRequest:
    """What a compression asks for, resolved and checked once (`resolve_request`); immutable, and trusted by
    whatever takes it."""

    method_name: str  # as registered, `+error-aware` included ("" for a method given as an instance)
    options: CheckedOptions | Mapping[str, object]
    requests: tuple[Request, ...]  # every request it was checked for (an eval's ratios; one for generate)
    artifact_files: tuple[Path, ...] = ()  # read when the method is built
    given_artifacts: tuple[Artifact, ...] = ()  # read already by the caller
    prefill_chunk_size: int | None = None
    kv_bits: int | None = None
    tuned_default: str | None = None  # the tuned_defaults file that chose the method, ratio and options
    note: str = ""  # why the method is not the one a reader of the model's artifacts would expect
    instance: Method | None = dataclasses.field(default=None, repr=False)  # a method given built

    @functools.cached_property
    def artifacts(self) -> tuple[Artifact, ...]:
        """Every artifact of the request, each file read once (the first time it is asked for)."""
        from ..artifacts.artifact import read_artifact

        return (*self.given_artifacts, *(read_artifact(path) for path in self.artifact_files))

    @functools.cached_property
    def method(self) -> Method:
        """The method, built once from the artifacts (the instance given, as it is)."""
        if self.instance is not None:
            return self.instance
        from .build import build_method

        return build_method(self.method_name, self.artifacts, self.options)

    def request(self, ratio: float | None = None, budget: int | None = None) -> Request:
        """The request among those checked that asks for `ratio` or `budget` (neither: the only one)."""
        if ratio is None and budget is None:
            if len(self.requests) != 1:
                raise KVRuntimeError(
                    f"this request was resolved for {len(self.requests)} ratios or budgets: give the one to serve"
                )
            return self.requests[0]
        for request in self.requests:
            if (request.ratio, request.budget) == (ratio, budget):
                return request
        asked = f"ratio {ratio}" if ratio is not None else f"budget {budget}"
        checked = ", ".join(request.describe() for request in self.requests)
        raise KVRuntimeError(f"{asked} was not among the requests resolved ({checked}): resolve it with them")


@headers_read_once()  # each artifact's header read once per request, however many checks ask
def resolve_request(
    method: str | Method | None = None,
    ratio: float | Sequence[float] | None = None,
    budget: int | None = None,
    memory: str = "padded",
    artifacts: Sequence[str | os.PathLike | Artifact] = (),
    options: Mapping[str, object] = {},
    prefill_chunk_size: int | None = None,
    kv_bits: int | None = None,
    default_ratio: float | None = None,
    artifact_folders: Sequence[Path] = (),
    nearest_budget: bool = False,
) -> ResolvedRequest:
    """Resolve and check a compression request once. `method` None takes the method, options and ratio of a
    tuned_defaults artifact among `artifacts` (its options joined by the ones given, its ratio unless one is given)
    and the artifacts it names; without one, the runtime's default method. `ratio` may list several ratios: one
    request each; `default_ratio` serves when neither a ratio, a budget nor a tuned default gives one.
    `artifacts`: files or bundles (checked from their headers, without torch) or artifacts read already (checked on
    the built method). Without any, the model's own are taken from `artifact_folders` (the first holding each
    kind): its tuned default where no method is named, else the kinds the method needs (`MissingArtifacts` where
    one is not there). `nearest_budget`: compilerkv's option, refused for a method the caller did not name that
    compiles no budgets."""
    read = tuple(source for source in artifacts if _read_already(source))
    files = tuple(artifact_files([source for source in artifacts if not _read_already(source)]))
    named, note = method is not None, ""
    if method is None and not artifacts and artifact_folders:
        method, files, note = _model_default(artifact_folders)
    tuned_default = None
    if method is None:
        tuned = tuned_defaults_among([*read, *files])
        if tuned is not None:
            tuned_default, defaults = tuned
            method, options, ratio = defaults.completed(options, ratio, budget)
            present = {path.resolve() for path in files}
            files += tuple(path for path in defaults.artifact_files if path.resolve() not in present)
        else:
            method = DEFAULT_METHOD
    if nearest_budget:
        if not named:
            chosen_by = "without --method or a tuned default, the method is"
            check_nearest_budget(method, f"the tuned default ({tuned_default}) chose" if tuned_default else chosen_by)
        options = {**options, "nearest_budget": True}
    if isinstance(method, str) and not artifacts and not files and artifact_folders:
        options = check_method_options(method, options)
        kinds = required_artifact_kinds(method, options)
        found = [_first_holding(artifact_folders, kind) for kind in kinds]
        missing = [kind for kind, path in zip(kinds, found) if path is None]
        if missing:
            raise MissingArtifacts(method, missing)
        files = tuple(found)
    if ratio is None and budget is None:
        ratio = default_ratio
    ratios = ratio if isinstance(ratio, list | tuple) else [ratio]
    requests = tuple(Request(r, budget, memory) for r in ratios)
    check_kv_bits(kv_bits)
    if not isinstance(method, str):  # an instance: its options are its fields, checked as a name's would be
        from .build import get_method

        resolved = ResolvedRequest(
            "", {}, requests, files, read, prefill_chunk_size, kv_bits, instance=get_method(method)
        )
        _check_built(resolved)
        return resolved
    options = check_method_options(method, options)
    resolved = ResolvedRequest(
        method, options, requests, files, read, prefill_chunk_size, kv_bits, tuned_default, note=note
    )
    try:
        if read:  # artifacts in memory have no headers to read: the method built from them checks
            _check_built(resolved)
        else:
            check_serves(method, files, options, requests, prefill_chunk_size)
    except KVRuntimeError as exc:
        if tuned_default is None:
            raise
        # Worded from what was asked: the method is not one the user named.
        raise KVRuntimeError(f"{exc} ({method} is what the tuned default {tuned_default} chose)") from None
    return resolved


def _check_built(resolved: ResolvedRequest) -> None:
    """The serving checks on the built method: what it refuses of the requests, a memory mode, a chunked prefill."""
    from ..requests.serving import check_memory
    from .base import check_prefill_chunk_size

    method = resolved.method
    for request in resolved.requests:
        method.check_request(request)
        check_memory(method.name, method.required_memory(), request.memory)
    check_prefill_chunk_size(method, resolved.prefill_chunk_size)


def _model_default(folders: Sequence[Path]) -> tuple[str | None, tuple[Path, ...], str]:
    """What a model's own folders say when no method is named: its tuned default (the method left to it), else the
    runtime's default, with a note saying why."""
    default = _first_holding(folders, TUNED_DEFAULTS)
    if default is None:  # nothing tuned for this model: the runtime's default, said (a tuned one may differ)
        return DEFAULT_METHOD, (), f"no tuned_defaults for this model (`kvcompile tune`); using {DEFAULT_METHOD}"
    if header_params(default).get("recommended") is None:
        # The model's own tuning found no method within its tolerance (shipped so, as the measurement it is): the
        # runtime's default serves, said in a note; a tuned_defaults the caller gives still refuses.
        return DEFAULT_METHOD, (), f"{default.name} recommends no method for this model; using {DEFAULT_METHOD}"
    return None, (default,), ""


def _first_holding(folders: Sequence[Path], kind: str) -> Path | None:
    """The artifact of `kind` in the first of `folders` that holds one (None: none does)."""
    return next(
        (folder / artifact_file_name(kind) for folder in folders if (folder / artifact_file_name(kind)).exists()), None
    )


def check_nearest_budget(method: str, chosen_by: str) -> None:
    """Refuse nearest_budget for a method the caller did not name and that compiles no budgets, in the words of
    what was asked (the method came from a tuned default or the runtime's default, `chosen_by`)."""
    spec = registration_of(method)
    if spec is not None and "nearest_budget" in spec.options:
        return
    compiling = " or ".join(name for name, other in METHODS.items() if "nearest_budget" in other.options)
    raise KVRuntimeError(
        f"--nearest-budget moves --budget to the nearest compiled budget, and {chosen_by} {method}, which compiles "
        f"none: give --method {compiling} with it, or leave it out"
    )


def tuned_defaults_among(artifacts: Sequence[Path | Artifact]) -> tuple[str, TunedDefaults] | None:
    """The file name and recommendation of the first tuned_defaults among `artifacts` (read already, or files read
    from their headers), None without one."""
    for source in artifacts:
        if _read_already(source) and source.kind == TUNED_DEFAULTS:
            return (source.path.name if source.path else TUNED_DEFAULTS), TunedDefaults.from_artifact(source)
        if not _read_already(source) and header_kind(source) == TUNED_DEFAULTS:
            return source.name, TunedDefaults.from_params(header_params(source), source)
    return None


def _read_already(source: object) -> bool:
    """Whether `source` is an artifact read already, asked without importing torch: an `Artifact` exists only once
    its module (which imports torch) has been imported."""
    module = sys.modules.get(f"{__name__.split('.')[0]}.artifacts.artifact")
    return module is not None and isinstance(source, module.Artifact)
