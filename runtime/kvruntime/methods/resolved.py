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

from ..artifacts.artifact_header import header_kind, header_params, headers_read_once
from ..artifacts.bundle import artifact_files
from ..artifacts.tuned_defaults import TunedDefaults
from ..errors import KVRuntimeError
from ..plumbing.quantized_cache import check_kv_bits
from ..registry import DEFAULT_METHOD
from ..requests.request import CheckedOptions, Request, check_method_options
from ..requests.serving import check_serves

if TYPE_CHECKING:
    from ..artifacts.artifact import Artifact
    from . import Method

TUNED_DEFAULTS = "tuned_defaults"


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
) -> ResolvedRequest:
    """Resolve and check a compression request once. `method` None takes the method, options and ratio of a
    tuned_defaults artifact among `artifacts` (its options joined by the ones given, its ratio unless one is given)
    and the artifacts it names; without one, the runtime's default method. `ratio` may list several ratios: one
    request each; `default_ratio` serves when neither a ratio, a budget nor a tuned default gives one.
    `artifacts`: files or bundles (checked from their headers, without torch) or artifacts read already (checked on
    the built method)."""
    read = tuple(source for source in artifacts if _read_already(source))
    files = tuple(artifact_files([source for source in artifacts if not _read_already(source)]))
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
    resolved = ResolvedRequest(method, options, requests, files, read, prefill_chunk_size, kv_bits, tuned_default)
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
