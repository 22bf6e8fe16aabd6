"""A method instance from its name, the artifacts it needs and its options, through its registration
(`kvruntime.registry`): `methods/<name>/method.py`'s `build`, then `+budgets`' layer budgets."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence

from ..artifact import Artifact, applied_form, read_artifact
from ..errors import KVRuntimeError
from ..registry import LAYER_BUDGETS_KIND, method_spec, registration_of
from ..request import Request, check_method_options, required_artifact_kinds
from ..serving import check_has_artifact, check_memory
from .base import Method, check_prefill_chunk_size
from .layer_budgets import WithLayerBudgets


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
    spec, budgets = method_spec(name)
    options = check_method_options(name, options)
    by_kind = {artifact.kind: artifact for artifact in artifacts}
    applied = {}
    for kind in required_artifact_kinds(name, options):
        check_has_artifact(name, kind, by_kind)
        applied[kind] = applied_form(by_kind[kind])
    build = importlib.import_module(f"{__package__}.{spec.name}.method").build
    method = build(applied.get(spec.needs), options)
    if budgets:  # registered `budgetable`: a scoring method, or one that applies the budgets itself
        layer_error = applied[LAYER_BUDGETS_KIND].tensors["layer_error"]
        method = method.with_layer_budgets(layer_error) or WithLayerBudgets(inner=method, layer_error=layer_error)
    return method


def check_method_serves(
    name: str,
    artifact_paths: Sequence[str | os.PathLike],
    options: Mapping[str, object],
    requests: Sequence[Request],
    prefill_chunk_size: int | None = None,
) -> list[Artifact]:
    """Build the method from its artifact files (read and checked, not yet against a model) and let it refuse any
    of `requests` it cannot serve, and a chunked prefill it cannot stream: what the command line asks before it
    loads the model. Returns the artifacts read, for `compress` to take without reading them again."""
    artifacts = [read_artifact(path) for path in artifact_paths]
    method = get_method(name, artifacts, options)
    for request in requests:
        method.check_request(request)
        check_memory(method.name, method.required_memory(), request.memory)
    check_prefill_chunk_size(method, prefill_chunk_size)
    return artifacts
