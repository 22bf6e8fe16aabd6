"""Compression methods by name, built with the compiled artifacts they need.

Names: `snapkv`, `kvcompress`, `srh` (needs an `srh_heads` artifact), `compresskv` (= `srh+budgets`),
`<name>+budgets` for any of these (and `distilled`) with the error-aware layer budgets of a `layer_budgets` artifact,
`compilerkv` (needs a `compilerkv_tables` artifact; options `nearest_budget`, `uniform_heads`, `fixed_threshold`, `elastic`)
and `kvcompose` (options `mode` = compiled, which needs a `kvcompose_stats` artifact, or dynamic; `unstructured`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..artifact import Artifact, applied_form, read_artifact
from ..errors import KVRuntimeError
from ..request import (
    METHOD_NAMES,
    NEEDS,
    Request,
    check_method_options,
    parse_method_name,
    required_artifact_kinds,
)
from ..serving import check_has_artifact, check_memory
from .base import LayerPrefill, Method, Prefill, ScoringMethod, Selection, check_prefill_chunk_size
from .compilerkv import CompilerKV
from .compresskv import SemanticRetrievalHeads, WithLayerBudgets
from .distilled import Distilled
from .kvcompose import KVCompose
from .kvcompress import KVCompress
from .snapkv import SnapKV

ARTIFACT_FREE: dict[str, type[Method]] = {cls.name: cls for cls in (SnapKV, KVCompress)}


def get_method(name: str | Method, artifacts: Sequence[Artifact] = (), options: Mapping[str, object] = {}) -> Method:
    """A method instance from its name, the artifacts it needs and method options; an instance is returned as is."""
    if isinstance(name, Method):
        if options:
            raise KVRuntimeError("method options go to a method given by name; set them on the instance instead")
        return name
    base, *suffixes = parse_method_name(name)
    by_kind = {artifact.kind: artifact for artifact in artifacts}

    def applied(part: str) -> object:
        kind = NEEDS[part]
        check_has_artifact(name, kind, by_kind)
        return applied_form(by_kind[kind])

    options = check_method_options(name, options)
    if base == "compilerkv":
        return CompilerKV(tables=applied("compilerkv"), **options)
    if base == "kvcompose":
        compiled = options.get("mode", "compiled") == "compiled"
        return KVCompose(stats=applied("kvcompose") if compiled else None, **options)
    if base == "distilled":
        layer_error = applied("budgets").tensors["layer_error"] if suffixes else None
        return Distilled(scorer=applied("distilled"), layer_error=layer_error, **options)
    if base == "srh":
        method: ScoringMethod = SemanticRetrievalHeads(head_scores=applied("srh").tensors["srh_score"])
    else:
        method = ARTIFACT_FREE[base]()
    if suffixes:
        method = WithLayerBudgets(inner=method, layer_error=applied("budgets").tensors["layer_error"])
    return method


def check_method_serves(
    name: str,
    artifact_paths: Sequence[str | os.PathLike],
    options: Mapping[str, object],
    requests: Sequence[Request],
    prefill_chunk_size: int | None = None,
) -> None:
    """Build the method from its artifact files (read and checked, not yet against a model) and let it refuse any
    of `requests` it cannot serve, and a chunked prefill it cannot stream: what the command line asks before it
    loads the model."""
    method = get_method(name, [read_artifact(path) for path in artifact_paths], options)
    for request in requests:
        method.check_request(request)
        check_memory(method.name, method.required_memory(), request.memory)
    check_prefill_chunk_size(method, prefill_chunk_size)


__all__ = [
    "METHOD_NAMES",
    "CompilerKV",
    "Distilled",
    "Prefill",
    "ScoringMethod",
    "Selection",
    "KVCompose",
    "KVCompress",
    "LayerPrefill",
    "Method",
    "SemanticRetrievalHeads",
    "SnapKV",
    "WithLayerBudgets",
    "check_method_serves",
    "check_prefill_chunk_size",
    "get_method",
    "parse_method_name",
    "required_artifact_kinds",
]
