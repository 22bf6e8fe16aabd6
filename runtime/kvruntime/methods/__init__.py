"""Compression methods by name, built with the compiled artifacts they need.

Names: `snapkv`, `kvcompress`, `srh` (needs an `srh_heads` artifact), `compresskv` (= `srh+budgets`),
`<name>+budgets` for any of these with the error-aware layer budgets of a `layer_budgets` artifact,
`compilerkv` (needs a `compilerkv_tables` artifact; options `nearest_budget`, `uniform_heads`, `fixed_threshold`)
and `kvcompose` (options `mode` = compiled, which needs a `kvcompose_stats` artifact, or dynamic; `unstructured`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..artifact import Artifact
from ..errors import KVRuntimeError
from ..compilerkv_tables import CompilerKVTables
from ..kvcompose_stats import KVComposeStats
from .base import Method, Prefill, ScoringMethod, Selection
from .compilerkv import CompilerKV
from .compresskv import SemanticRetrievalHeads, WithLayerBudgets
from .kvcompose import KVCompose
from .kvcompress import KVCompress
from .snapkv import SnapKV
from ..request import METHOD_NAMES, NEEDS, check_method_options, parse_method_name, required_artifact_kinds

ARTIFACT_FREE: dict[str, type[Method]] = {cls.name: cls for cls in (SnapKV, KVCompress)}
def get_method(name: str | Method, artifacts: Sequence[Artifact] = (), options: Mapping[str, object] = {}) -> Method:
    """A method instance from its name, the (already model-checked) artifacts and method options; an instance is
    returned as is."""
    if isinstance(name, Method):
        if options:
            raise KVRuntimeError("method options go to a method given by name; set them on the instance instead")
        return name
    base, *suffixes = parse_method_name(name)
    by_kind = {artifact.kind: artifact for artifact in artifacts}

    def artifact_for(part: str) -> Artifact:
        kind, command = NEEDS[part]
        if kind not in by_kind:
            raise KVRuntimeError(f"method {name!r} needs a {kind} artifact for this model (compile it with `{command}`)")
        return by_kind[kind]

    options = check_method_options(name, options)
    if base == "compilerkv":
        return CompilerKV(tables=CompilerKVTables.from_artifact(artifact_for("compilerkv")), **options)
    if base == "kvcompose":
        compiled = options.get("mode", "compiled") == "compiled"
        stats = KVComposeStats.from_artifact(artifact_for("kvcompose")) if compiled else None
        return KVCompose(stats=stats, **options)
    if base == "srh":
        method: ScoringMethod = SemanticRetrievalHeads(head_scores=artifact_for("srh").tensors["srh_score"])
    else:
        method = ARTIFACT_FREE[base]()
    if suffixes:
        method = WithLayerBudgets(inner=method, layer_error=artifact_for("budgets").tensors["layer_error"])
    return method


__all__ = [
    "METHOD_NAMES",
    "CompilerKV",
    "Prefill",
    "ScoringMethod",
    "Selection",
    "KVCompose",
    "KVCompress",
    "Method",
    "SemanticRetrievalHeads",
    "SnapKV",
    "WithLayerBudgets",
    "get_method",
    "parse_method_name",
    "required_artifact_kinds",
]
