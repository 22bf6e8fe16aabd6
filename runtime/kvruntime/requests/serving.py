"""What a method can serve, decided without torch from its name, its options and its artifacts' headers: the
refusals the command line makes before it imports anything heavy. The methods apply the same rules (chunk size,
memory mode) through these functions, and their compiled operating points through their own folder's
`operating_points.py` (`registry.operating_point_check`); their fixed facts (window, whether the prefill can stream,
the memory mode they need) are their registrations' (`registry`), and a test holds every method to them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping, Sequence

from ..artifacts.artifact_header import read_header
from ..artifacts.artifact_kinds import ARTIFACT_KINDS
from ..errors import KVRuntimeError
from ..registry import canonical_name, method_spec, operating_point_check
from .request import Request, check_method_options, required_artifact_kinds


@dataclasses.dataclass(frozen=True)
class MethodFacts:
    name: str  # as the method calls itself in messages and reports
    window: int
    streams: bool  # its layer budgets are known before any layer's scores: the prefill can go in chunks
    memory: str | None  # the memory mode it needs (None: either)


def method_facts(name: str, options: Mapping[str, object] = {}) -> MethodFacts:
    """What a method name with these options is, from its registration (`+error-aware`' layer shares are known from
    their artifact, so it streams)."""
    spec, budgets = method_spec(name)
    streams = budgets or spec.streams(options)
    window = int(options.get("window", spec.window))
    return MethodFacts(canonical_name(name), window, streams, spec.memory(options))


def check_chunk_size(name: str, window: int, streams: bool, size: int | None) -> None:
    """Refuse a chunk size that is not a positive number of tokens at least the method's window, or a method that
    cannot stream (its layer budgets need every layer's scores)."""
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise KVRuntimeError(f"prefill_chunk_size {size!r} must be a positive whole number of tokens")
    if not streams:
        raise KVRuntimeError(
            f"{name} cannot stream the prefill in chunks: its layer budgets need every layer's scores "
            "(drop prefill_chunk_size, or use a method whose budgets are known in advance)"
        )
    if size < window:
        raise KVRuntimeError(
            f"prefill_chunk_size {size} is smaller than {name}'s window of {window} tokens: the last chunk must hold "
            "the window"
        )


def check_memory(name: str, required: str | None, memory: str) -> None:
    if required not in (None, memory):
        raise KVRuntimeError(
            f"{name} with these options keeps different numbers of entries per head: use memory={required!r}"
        )


def compiled_ratios(values: Sequence[float]) -> tuple[float, ...]:
    """kvcompose's compiled ratios as stored (float32) read back to the ratios asked for."""
    return tuple(round(float(r), 6) for r in values)


def check_has_artifact(name: str, kind: str, kinds: Collection[str]) -> None:
    """Refuse method `name` without an artifact of `kind` among the `kinds` given."""
    if kind not in kinds:
        raise KVRuntimeError(
            f"method {name!r} needs a {kind} artifact for this model (compile it with `{ARTIFACT_KINDS[kind].command}`)"
        )


def check_serves(
    name: str,
    artifact_paths: Sequence[str | os.PathLike],
    options: Mapping[str, object],
    requests: Sequence[Request],
    prefill_chunk_size: int | None = None,
) -> None:
    """Refuse, from the artifacts' headers alone, what method `name` cannot serve: a missing or unreadable artifact
    (or one of the wrong kind), a request outside its compiled operating points or in a memory mode it cannot use,
    a chunked prefill it cannot stream. The artifacts' tensors are checked when the method is built."""
    options = check_method_options(name, options)
    by_kind = {}
    for path in artifact_paths:
        by_kind[read_header(path).get("kind")] = path  # refuses a missing, foreign or unreadable file
    for kind in required_artifact_kinds(name, options):
        check_has_artifact(name, kind, by_kind)
    facts = method_facts(name, options)
    spec = method_spec(name)[0]
    # The operating points compiled into its artifact, read once for every request.
    artifact = by_kind.get(spec.needs) if spec.needs_artifact(options) else None
    check_operating_point = operating_point_check(spec, artifact, options) if artifact else None
    for request in requests:
        if check_operating_point is not None:
            check_operating_point(request)
        check_memory(facts.name, facts.memory, request.memory)
    check_chunk_size(facts.name, facts.window, facts.streams, prefill_chunk_size)
