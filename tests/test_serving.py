"""The command line's torch-free view of each method (`kvruntime.serving`: declared windows, streaming and memory,
refusals read from the artifacts' headers) agrees with the method built from its artifacts, for every method and
option that changes them, on the shipped artifacts."""

from __future__ import annotations

import itertools

import pytest

from kvcompile.recipe import artifact_folder
from kvruntime import KVRuntimeError, Request, get_method, read_artifact
from kvruntime.methods import check_method_serves
from kvruntime.registry import BUDGETABLE_NAMES, METHOD_NAMES
from kvruntime.request import required_artifact_kinds
from kvruntime.serving import check_serves, method_facts

ARTIFACTS = artifact_folder("default")
COMBOS = [
    *((name, {}) for name in ("snapkv", "kvcompress", "srh", "compresskv", "compilerkv")),
    *(
        ("kvcompose", {"mode": m, "unstructured": u})
        for m, u in itertools.product(("compiled", "dynamic"), (False, True))
    ),
    *(("distilled", {"allocation": a}) for a in ("dynamic", "compiled", "uniform")),
    *((f"{name}+budgets", {}) for name in BUDGETABLE_NAMES),
    # every method takes the window as an option
    *((name, {"window": 16}) for name in ("snapkv", "srh", "compresskv", "compilerkv", "kvcompose", "distilled")),
    ("distilled+budgets", {"window": 128}),
]


def paths(name: str, options: dict) -> list:
    return [ARTIFACTS / f"{kind}.safetensors" for kind in required_artifact_kinds(name, options)]


def test_every_method_is_covered():
    assert {name.partition("+")[0] for name, _ in COMBOS} | {"compresskv"} == set(METHOD_NAMES)


@pytest.mark.parametrize("name, options", COMBOS, ids=lambda x: str(x))
def test_declared_facts_are_the_methods_own(name, options):
    method = get_method(name, [read_artifact(p) for p in paths(name, options)], options)
    facts = method_facts(name, options)
    assert (facts.name, facts.window, facts.streams, facts.memory) == (
        method.name,
        method.window,
        method.budgets_known_in_advance,
        method.required_memory(),
    )


def outcome(check, *args) -> str:
    try:
        check(*args)
    except KVRuntimeError as exc:
        return str(exc)
    return "served"


REQUESTS = [Request(ratio=r) for r in (0.05, 0.5, 0.99)] + [Request(budget=b) for b in (256, 300, 512)]


@pytest.mark.parametrize("name, options", [*COMBOS, ("compilerkv", {"nearest_budget": True})], ids=lambda x: str(x))
@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.describe())
@pytest.mark.parametrize("chunk", [None, 4, 512])
def test_the_header_check_refuses_exactly_what_the_built_method_refuses(name, options, request_, chunk):
    built = outcome(check_method_serves, name, paths(name, options), options, [request_], chunk)
    read = outcome(check_serves, name, paths(name, options), options, [request_], chunk)
    assert read == built
