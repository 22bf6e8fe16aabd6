"""The command line's torch-free view of each method (`kvruntime.requests.serving`: declared windows, streaming and memory,
refusals read from the artifacts' headers) agrees with the method built from its artifacts, for every method and
option that changes them, on the shipped artifacts."""

from __future__ import annotations

import pytest

from kvcompile import recipe
from kvcompile.recipe import artifact_folder
from kvruntime import KVRuntimeError, Request, get_method, read_artifact
from kvruntime.artifacts.fingerprint import model_fingerprint
from kvruntime.methods.resolved import resolve_request
from kvruntime.registry import ALIASES, ERROR_AWARE_NAMES, METHODS, MethodSpec
from kvruntime.requests.request import required_artifact_kinds
from kvruntime.requests.serving import method_facts

ARTIFACTS = artifact_folder("default")


def option_variants(spec: MethodSpec) -> list[dict]:
    """Its defaults, each other value of each of its words and switches alone, and a window of 16."""
    variants: list[dict] = [{}]
    for key, option in spec.options.items():
        values = option.kind if isinstance(option.kind, tuple) else (False, True) if option.kind is bool else ()
        variants += [{key: value} for value in values if value != option.default]
    return [*variants, {"window": 16}]


# Every registered method and alias, every `+error-aware`: derived from the registry, so a method added is covered.
COMBOS = [
    *((name, options) for name, spec in METHODS.items() for options in option_variants(spec)),
    *((alias, {}) for alias in ALIASES),
    *((f"{name}+error-aware", options) for name in ERROR_AWARE_NAMES for options in ({}, {"window": 16})),
]


def paths(name: str, options: dict) -> list:
    return [ARTIFACTS / f"{kind}.safetensors" for kind in required_artifact_kinds(name, options)]


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


@pytest.mark.parametrize("name, options", COMBOS, ids=lambda x: str(x))
@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.describe())
@pytest.mark.parametrize("chunk", [None, 4, 512])
def test_the_header_check_refuses_exactly_what_the_built_method_refuses(name, options, request_, chunk):
    """Resolved from files, a request is checked from their headers (`check_serves`); from artifacts read already,
    on the method built from them: both refuse the same requests in the same words."""
    amount = dict(ratio=request_.ratio, budget=request_.budget)
    read = [read_artifact(p) for p in paths(name, options)]
    built = outcome(resolve_request, name, *amount.values(), "padded", read, options, chunk)
    from_headers = outcome(resolve_request, name, *amount.values(), "padded", paths(name, options), options, chunk)
    assert from_headers == built


def count_calls(monkeypatch, calls: list, owner: object, name: str, label: object) -> None:
    """Each call of `owner.name` (a module's function, or a class's method) appends `label(*args)` to `calls`."""
    function = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args: calls.append(label(*args)) or function(*args))


def count_resolution(monkeypatch, calls: list, methods: tuple[str, ...]) -> None:
    """Count what resolving and serving a request does: each option value checked (its key), each artifact header
    and tensor read, each method built ("build <name>"), each serving check on the headers ("serving") and each
    check on a built method ("method check")."""
    import importlib

    import kvruntime.artifacts.artifact
    import kvruntime.artifacts.artifact_header
    import kvruntime.methods.resolved
    import kvruntime.requests.request
    from kvruntime.methods.base import Method

    count_calls(
        monkeypatch, calls, kvruntime.requests.request, "check_option_value", lambda method, key, option, value: key
    )
    count_calls(
        monkeypatch, calls, kvruntime.artifacts.artifact_header, "_header", lambda source: ("header", source.name)
    )
    count_calls(monkeypatch, calls, kvruntime.artifacts.artifact, "_read_safetensors", lambda data: "tensors")
    count_calls(monkeypatch, calls, kvruntime.methods.resolved, "check_serves", lambda *args: "serving")
    count_calls(monkeypatch, calls, Method, "check_request", lambda *args: "method check")
    for name in methods:
        module = importlib.import_module(f"kvruntime.methods.{name}.method")
        count_calls(monkeypatch, calls, module, "build", lambda artifact, options, name=name: f"build {name}")


def test_a_generate_request_is_resolved_once_from_the_command_line_to_the_prefill(tmp_path, tokens, monkeypatch):
    """`kvcompile generate --method distilled --option ... --artifact ...`: the options are parsed in their declared
    types; resolving the request and compressing with it check each option once, read each artifact's header once
    and its tensors once, run the serving checks once and build the method once (later steps trust it)."""
    from conftest import scorer_that_prefers, tiny_model

    from kvcompile.cli.generation import GenerateOptions, compression_asked
    from kvruntime import compress, save_artifact
    from kvruntime.requests.request import kept_per_head, parse_option_pairs

    model = tiny_model("llama")
    scorer = save_artifact(scorer_that_prefers(model, 0), tmp_path / "distilled_scorer.safetensors")
    options = parse_option_pairs(["window=8", "floor=0.5", "allocation=uniform", "copy_penalty=0"], "distilled")
    assert options == {"window": 8, "floor": 0.5, "allocation": "uniform", "copy_penalty": 0.0}
    assert [type(value) for value in options.values()] == [int, float, str, float]  # as the method declares them
    calls: list = []
    count_resolution(monkeypatch, calls, ("distilled",))
    monkeypatch.setattr(recipe, "model_identity", lambda name: model_fingerprint(model))  # the scorer's model
    settings = GenerateOptions([], method="distilled", ratio=0.5, artifact=[scorer], prefill_chunk_size=16)
    asked = compression_asked(settings, options, None)
    with compress(model, asked) as session:
        session.prefill(tokens)
        session.prefill(tokens)  # a second prompt in the block: nothing resolved again
    expected = [*options, ("header", scorer.name), "tensors", "serving", "build distilled"]
    assert sorted(calls, key=str) == sorted(expected, key=str)
    layers = model.config.num_hidden_layers
    assert session.report.slots_per_layer == [kept_per_head(80, 8, ratio=0.5)] * layers


def test_generate_without_a_method_reads_each_artifact_of_the_tuned_default_once(monkeypatch):
    """`kvcompile generate` with no --method on the default model: its tuned default chooses the method (asked whether
    it recommends one, looked up among the artifacts, checked with the others); every header is read once, every
    file's tensors once, one serving check, one build."""
    from kvcompile.cli.generation import GenerateOptions, compression_asked

    calls: list = []
    count_resolution(monkeypatch, calls, ("srh",))
    asked = compression_asked(GenerateOptions([]), {}, None)
    assert (asked.method_name, asked.tuned_default) == ("compresskv", "tuned_defaults.safetensors")
    files = ["layer_budgets.safetensors", "srh_heads.safetensors", "tuned_defaults.safetensors"]
    expected = [*(("header", name) for name in files), *["tensors"] * 3, "serving", "build srh"]
    # Finding the model's artifacts reads one header of each shipped folder besides (`recipe.folder_identity`).
    of_the_request = [call for call in calls if not (isinstance(call, tuple) and call[1] not in files)]
    assert sorted(of_the_request, key=str) == sorted(expected, key=str)
    calls.clear()  # the same from Python: `resolve_request` given the tuned default alone
    resolve_request(artifacts=[asked.artifact_files[0]])
    assert sorted(calls, key=str) == sorted([*(("header", name) for name in files), "serving"], key=str)
    calls.clear()  # the tuned default's artifacts given explicitly beside it: each still read once
    given = resolve_request(artifacts=list(reversed(asked.artifact_files)))
    assert sorted(path.name for path in given.artifact_files) == files
    _ = given.method
    expected = [*(("header", name) for name in files), *["tensors"] * 3, "serving", "build srh"]
    assert sorted(calls, key=str) == sorted(expected, key=str)


def test_a_model_whose_shipped_tuning_recommends_nothing_gets_the_runtime_default_with_a_note():
    """Gemma's shipped tuned_defaults found no method within its tolerance: `kvcompile generate --model gemma-3-270m`
    without --method serves the runtime's default (and says why) instead of refusing; the default model's tuning
    still names its method, ratio and artifacts."""
    from kvcompile.cli.generation import GenerateOptions, compression_asked
    from kvruntime.registry import DEFAULT_METHOD

    gemma = compression_asked(GenerateOptions([], model="gemma-3-270m"), {}, None)
    assert (gemma.method_name, gemma.request().ratio, gemma.artifacts) == (DEFAULT_METHOD, 0.5, ())
    assert gemma.note == f"tuned_defaults.safetensors recommends no method for this model; using {DEFAULT_METHOD}"
    default = compression_asked(GenerateOptions([]), {}, None)
    assert (default.method_name, default.request().ratio, default.note) == ("compresskv", 0.25, "")
    assert (default.method.name, default.tuned_default) == ("compresskv", "tuned_defaults.safetensors")
    assert sorted(a.kind for a in default.artifacts) == ["layer_budgets", "srh_heads", "tuned_defaults"]


def test_a_resolved_request_serves_what_it_was_resolved_for_and_takes_nothing_beside(tokens):
    """`compress` given a resolved request serves one of its requests (the only one, or the ratio named), refuses
    another, and refuses what the resolved request already holds (options, artifacts, memory, chunks, kv_bits)."""
    from conftest import tiny_model

    from kvruntime import compress, resolve_request

    model = tiny_model("llama")
    resolved = resolve_request("snapkv", ratio=[0.5, 0.75])
    with pytest.raises(KVRuntimeError, match="^this request was resolved for 2 ratios or budgets: give the one"):
        with compress(model, resolved):
            pass
    with pytest.raises(
        KVRuntimeError, match=r"^ratio 0.6 was not among the requests resolved \(ratio 0.5, ratio 0.75\)"
    ):
        with compress(model, resolved, ratio=0.6):
            pass
    for beside in ({"options": {"window": 8}}, {"memory": "masked"}, {"prefill_chunk_size": 16}):
        with pytest.raises(KVRuntimeError, match="give only ratio or budget beside it$"):
            with compress(model, resolved, ratio=0.5, **beside):
                pass
    with compress(model, resolved, ratio=0.75) as session:
        session.prefill(tokens)
    assert session.report.requested == "ratio 0.75"
    assert session.method is resolved.method  # built once, for every block that serves it
