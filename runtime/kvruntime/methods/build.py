"""A method instance from its name, the artifacts it needs and its options, through its registration
(`kvruntime.registry`): `methods/<name>/method.py`'s `build`, then `+error-aware`' layer budgets."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

from ..artifacts.artifact import Artifact
from ..artifacts.tuned_defaults import TunedDefaults
from ..errors import KVRuntimeError
from ..registry import LAYER_BUDGETS_KIND, method_spec, registration_of
from ..requests.request import check_method_options, required_artifact_kinds
from ..requests.serving import check_has_artifact
from .base import Method
from .compilerkv.tables import CompilerKVTables
from .distilled.scorer import DistilledScorer
from .kvcompose.stats import KVComposeStats
from .layer_budgets import WithLayerBudgets

# The class whose `from_artifact` turns an artifact of a kind into what the runtime applies (a kind not here is
# applied as the artifact itself: a method reads its tensors directly).
READERS = {
    "compilerkv_tables": CompilerKVTables,
    "kvcompose_stats": KVComposeStats,
    "tuned_defaults": TunedDefaults,
    "distilled_scorer": DistilledScorer,
}


def get_method(name: str | Method, artifacts: Sequence[Artifact] = (), options: Mapping[str, object] = {}) -> Method:
    """A method instance from its name, the artifacts it needs and method options; an instance is returned as is, its
    options (the fields its registration declares) checked as a name's would be."""
    if isinstance(name, Method):
        if options:
            raise KVRuntimeError("method options go to a method given by name; set them on the instance instead")
        spec = registration_of(name.name)
        if spec is not None:  # a method not registered has no declared options
            fields = {key: getattr(name, key) for key in spec.all_options if hasattr(name, key)}
            check_method_options(spec.name, fields)
        return name
    return build_method(name, artifacts, options)


def build_method(name: str, artifacts: Sequence[Artifact], options: Mapping[str, object]) -> Method:
    """The method `name` built from its artifacts (those of other kinds left aside) and its options."""
    spec, budgets = method_spec(name)
    options = check_method_options(name, options)
    by_kind = {artifact.kind: artifact for artifact in artifacts}
    applied = {}
    for kind in required_artifact_kinds(name, options):
        check_has_artifact(name, kind, by_kind)
        applied[kind] = applied_form(by_kind[kind])
    build = importlib.import_module(f"{__package__}.{spec.name}.method").build
    method = build(applied.get(spec.needs), options)
    if budgets:  # registered `error_aware`: a scoring method, or one that applies the budgets itself
        layer_error = applied[LAYER_BUDGETS_KIND].tensors["layer_error"]
        method = method.with_layer_budgets(layer_error) or WithLayerBudgets(inner=method, layer_error=layer_error)
    return method


def applied_form(artifact: Artifact) -> object:
    """What the runtime applies of an artifact: read by its kind's reader (`READERS`), else the artifact itself."""
    reader = READERS.get(artifact.kind)
    return artifact if reader is None else reader.from_artifact(artifact)
