"""Compression methods by name, built with the compiled artifacts they need.

Names: `snapkv`, `kvcompress`, `srh` (needs an `srh_heads` artifact), `compresskv` (= `srh+budgets`), and
`<name>+budgets` for any of them with the error-aware layer budgets of a `layer_budgets` artifact.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..artifact import Artifact
from ..errors import KVRuntimeError
from .base import Method
from .compresskv import SemanticRetrievalHeads, WithLayerBudgets
from .kvcompress import KVCompress
from .snapkv import SnapKV

ARTIFACT_FREE: dict[str, type[Method]] = {cls.name: cls for cls in (SnapKV, KVCompress)}
METHOD_NAMES = ("snapkv", "kvcompress", "srh", "compresskv")
ALIASES = {"compresskv": "srh+budgets"}
# Which artifact kind each name part needs, and the command that compiles it.
NEEDS = {"srh": ("srh_heads", "kvcompile heads"), "budgets": ("layer_budgets", "kvcompile budgets")}


def parse_method_name(name: str) -> list[str]:
    """The parts of a method name ('compresskv' -> ['srh', 'budgets']); refuses unknown names."""
    parts = ALIASES.get(name, name).split("+")
    if parts[0] not in (*ARTIFACT_FREE, "srh") or parts[1:] not in ([], ["budgets"]):
        raise KVRuntimeError(f"unknown method {name!r} (available: {', '.join(METHOD_NAMES)}, and <method>+budgets)")
    return parts


def required_artifact_kinds(name: str) -> list[str]:
    return [NEEDS[part][0] for part in parse_method_name(name) if part in NEEDS]


def get_method(name: str | Method, artifacts: Sequence[Artifact] = ()) -> Method:
    """A method instance from its name and the (already model-checked) artifacts; an instance is returned as is."""
    if isinstance(name, Method):
        return name
    base, *suffixes = parse_method_name(name)
    by_kind = {artifact.kind: artifact for artifact in artifacts}

    def artifact_for(part: str) -> Artifact:
        kind, command = NEEDS[part]
        if kind not in by_kind:
            raise KVRuntimeError(f"method {name!r} needs a {kind} artifact for this model (compile it with `{command}`)")
        return by_kind[kind]

    if base == "srh":
        method: Method = SemanticRetrievalHeads(head_scores=artifact_for("srh").tensors["srh_score"])
    else:
        method = ARTIFACT_FREE[base]()
    if suffixes:
        method = WithLayerBudgets(inner=method, layer_error=artifact_for("budgets").tensors["layer_error"])
    return method


__all__ = [
    "METHOD_NAMES",
    "KVCompress",
    "Method",
    "SemanticRetrievalHeads",
    "SnapKV",
    "WithLayerBudgets",
    "get_method",
    "parse_method_name",
    "required_artifact_kinds",
]
