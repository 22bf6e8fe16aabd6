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


def test_a_generate_requests_options_and_artifacts_are_checked_once_from_the_command_line_to_the_prefill(
    tmp_path, tokens, monkeypatch
):
    """`kvcompile generate --method distilled --option ... --artifact ...`: the torch-free checks, the artifacts'
    check and the compression itself check each option once and read each artifact's header once and its tensors
    once (the command line's checks are the only ones; later steps trust them)."""
    from conftest import scorer_that_prefers, tiny_model

    import kvruntime.artifact
    import kvruntime.artifact_header
    import kvruntime.request
    from kvcompile.generation import compression_asked
    from kvruntime import compress, save_artifact

    model = tiny_model("llama")
    scorer = save_artifact(scorer_that_prefers(model, 0), tmp_path / "distilled_scorer.safetensors")
    calls = []

    def counted(module: object, name: str, label: object) -> None:
        function = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args: calls.append(label(*args)) or function(*args))

    counted(kvruntime.request, "check_option_value", lambda method, key, option, value: key)
    counted(kvruntime.artifact_header, "_header", lambda source: ("header", source.name))
    counted(kvruntime.artifact, "_read_safetensors", lambda data: "tensors")
    options = {"window": 8.0, "floor": 0.5, "allocation": "uniform"}  # as the command line reads them
    asked = compression_asked("default", "distilled", 0.5, None, "padded", [scorer], options, False, 16, None)
    with compress(
        model, asked.method, ratio=asked.ratio, artifacts=asked.artifacts, options=asked.options, prefill_chunk_size=16
    ) as session:
        session.prefill(tokens)
    assert sorted(calls, key=str) == sorted([*options, ("header", scorer.name), "tensors"], key=str)
    layers = model.config.num_hidden_layers
    assert session.report.slots_per_layer == [kvruntime.request.kept_per_head(80, 8, ratio=0.5)] * layers


def test_a_model_whose_shipped_tuning_recommends_nothing_gets_the_runtime_default_with_a_note():
    """Gemma's shipped tuned_defaults found no method within its tolerance: `kvcompile generate --model gemma-3-270m`
    without --method serves the runtime's default (and says why) instead of refusing; the default model's tuning
    still names its method, ratio and artifacts."""
    from kvcompile.generation import compression_asked
    from kvruntime.registry import DEFAULT_METHOD

    gemma = compression_asked("gemma-3-270m", None, None, None, "padded", [], {}, False, None, None)
    assert (gemma.method, gemma.ratio, gemma.artifacts) == (DEFAULT_METHOD, 0.5, [])
    assert gemma.note == f"tuned_defaults.safetensors recommends no method for this model; using {DEFAULT_METHOD}"
    default = compression_asked("default", None, None, None, "padded", [], {}, False, None, None)
    assert (default.method, default.ratio, default.note) == ("compresskv", 0.25, "")
    assert sorted(a.kind for a in default.artifacts) == ["layer_budgets", "srh_heads"]
