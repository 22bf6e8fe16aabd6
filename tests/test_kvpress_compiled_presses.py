"""kvpress presses built from compiled artifacts (`kvruntime.integrations.kvpress`), with the real kvpress (the bench
venv: `make test-bench`; skipped where kvpress is not installed). Each press keeps, in kvpress's own cache, exactly
the entries kvruntime's method keeps for the same artifact and ratio (kvruntime's selection and cache cut are the
independent reference); kvpress's contract holds (ratio honoured, hooks gone, wrappers run); a mismatched artifact
is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import import_kvpress, place_in_hub_cache
from test_selection_references import eight_head_model
from transformers import DynamicCache

import kvruntime
from kvruntime.methods.distilled import feature_count
from kvruntime.models.layout import model_layout

kvpress = import_kvpress()
from kvruntime.integrations.kvpress import DistilledPress, SRHPress  # noqa: E402  (needs kvpress)

LENGTH, RATIO = 160, 0.5
# Each press and the kvruntime method (name, options) whose selection it must reproduce.
PRESSES = {
    "distilled": (DistilledPress, "distilled", {"allocation": "uniform", "copy_penalty": 0.0}),
    "srh": (SRHPress, "srh", {}),
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return eight_head_model(request.param)


@pytest.fixture(scope="module")
def artifacts(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of artifacts for the tiny model, named as kvcompile names them: a distilled scorer reading every
    feature and SRH head scores, both random."""
    fingerprint = kvruntime.model_fingerprint(model)
    generator = torch.Generator().manual_seed(11)
    shape = (fingerprint.num_layers, feature_count(model.config.hidden_size), fingerprint.num_kv_heads)
    scorer = torch.randn(*shape, generator=generator)
    heads = torch.rand(fingerprint.num_layers, fingerprint.num_query_heads, generator=generator)
    folder = tmp_path_factory.mktemp("artifacts")
    kvruntime.save_artifact(
        kvruntime.Artifact("distilled_scorer", {"weights": scorer}, fingerprint, {}, {"oracle": "reconstruction"}),
        folder / "distilled_scorer.safetensors",
    )
    kvruntime.save_artifact(
        kvruntime.Artifact("srh_heads", {"srh_score": heads}, fingerprint, {}, {}), folder / "srh_heads.safetensors"
    )
    return folder


@pytest.fixture(scope="module")
def context() -> torch.Tensor:
    return torch.randint(3, 96, (1, LENGTH), generator=torch.Generator().manual_seed(8))


def full_keys(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [layer.keys for layer in model(ids, use_cache=True).past_key_values.layers]


def kept_positions(kept: torch.Tensor, full: torch.Tensor) -> list[list[int]]:
    """Where each kept key [1, Hkv, k, D] sits in the full cache's keys [1, Hkv, N, D], sorted, per KV head: the
    prefill's keys do not depend on the compression of earlier layers, so every kept key is one of them."""
    positions = []
    for head in range(kept.shape[1]):
        distances = (kept[0, head, :, None] - full[0, head, None]).abs().amax(dim=-1)  # [k, N]
        assert bool((distances.min(dim=-1).values == 0).all())
        positions.append(sorted(distances.argmin(dim=-1).tolist()))
    return positions


def transformers_cache(model: torch.nn.Module) -> DynamicCache:
    return DynamicCache(config=model.config)


def hook_counts(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_the_press_keeps_what_kvruntime_keeps(model, artifacts, context, name):
    press_type, method, options = PRESSES[name]
    press = press_type.from_artifact(artifacts, compression_ratio=RATIO)
    cache = transformers_cache(model)
    hooks = hook_counts(model)
    with torch.no_grad(), press(model):
        model(input_ids=context, past_key_values=cache, use_cache=True)
    assert hook_counts(model) == hooks  # kvpress removed its hooks
    with kvruntime.compress(model, method, ratio=RATIO, artifacts=list(artifacts.iterdir()), options=options) as s:
        s.prefill(context)
    full = full_keys(model, context)
    for layer, ours in enumerate(s.kept_positions):
        theirs = kept_positions(cache.layers[layer].keys, full[layer])
        assert len(theirs[0]) == LENGTH * (1 - RATIO)  # kvpress's ratio honoured
        assert theirs == [sorted(head.tolist()) for head in ours[0]], f"layer {layer}"


def test_the_distilled_press_runs_under_kvpress_wrappers(model, artifacts, context):
    """AdaKV (per-head budgets across a layer) and DMS (a score threshold) take our scores: AdaKV holds the ratio
    over the layer's entries, DMS masks the tokens scored under its threshold outside its sliding window."""
    from kvpress import AdaKVPress, DMSPress

    inner = DistilledPress.from_artifact(artifacts, compression_ratio=RATIO)
    with torch.no_grad(), AdaKVPress(inner)(model):
        model(input_ids=context, past_key_values=transformers_cache(model), use_cache=True)
    hidden = [m.masked_key_indices for m in model_layout(model).cut_modules]
    assert all(len(h[0]) == pytest.approx(RATIO * LENGTH * model.config.num_key_value_heads, abs=2) for h in hidden)
    for module in model_layout(model).cut_modules:
        module.masked_key_indices = None

    # The scorer's own scores (no leverage mixed in: the reference below is the scorer's map alone).
    dms = DMSPress(DistilledPress.from_artifact(artifacts, leverage=0.0), threshold=0.0, sliding_window_size=16)
    with torch.no_grad(), dms(model):
        model(input_ids=context, past_key_values=transformers_cache(model), use_cache=True)
    masked = [module.masked_key_indices for module in model_layout(model).cut_modules]
    for module in model_layout(model).cut_modules:
        module.masked_key_indices = None
    scores = [inner.method.token_scores(i, h) for i, h in enumerate(attention_inputs(model, context))]
    evictable = LENGTH - max(16, inner.method.window)  # outside DMS's sliding window and the press's own window
    for indices, layer_scores in zip(masked, scores):
        below = (layer_scores[..., :evictable] < 0.0).nonzero(as_tuple=True)
        assert len(below[0]) > 0
        assert sorted(zip(*(i.tolist() for i in indices))) == sorted(zip(*(i.tolist() for i in below)))


def attention_inputs(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each attention module's input hidden states [1, N, hidden] on a plain forward."""
    seen: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda mod, args, kwargs, out: seen.append(kwargs["hidden_states"]), with_kwargs=True)
        for m in model_layout(model).cut_modules
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_an_artifact_of_another_model_is_refused(model, artifacts, context):
    other = eight_head_model("qwen2" if model.config.model_type != "qwen2" else "llama")
    press = DistilledPress.from_artifact(artifacts / "distilled_scorer.safetensors", compression_ratio=RATIO)
    hooks = hook_counts(other)
    with pytest.raises(kvruntime.ArtifactError, match="compiled for another"), press(other):
        pass
    assert hook_counts(other) == hooks


def test_a_press_from_a_bundle_by_folder_and_by_hub_id_scores_as_from_its_file(
    model, artifacts, context, tmp_path, monkeypatch
):
    """`kvcompile bundle` of the artifacts, then the press from the bundle's folder and from a hub repo id in a local
    Hugging Face cache (offline): the press keeps the same keys as the press from the file."""
    import huggingface_hub.constants

    from kvcompile.bundle import write_bundle

    bundle = tmp_path / "bundle"
    write_bundle(sorted(artifacts.glob("*.safetensors")), bundle)
    place_in_hub_cache(bundle, tmp_path / "hub", "someone/tiny-bundle")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    kept = []  # the cache each press leaves: the same keys kept
    for source in (artifacts / "distilled_scorer.safetensors", bundle, "someone/tiny-bundle"):
        press = DistilledPress.from_artifact(source, compression_ratio=RATIO)
        cache = transformers_cache(model)
        with torch.no_grad(), press(model):
            model(input_ids=context, past_key_values=cache, use_cache=True)
        kept.append([layer.keys for layer in cache.layers])
    for layer in range(len(kept[0])):
        assert torch.equal(kept[0][layer], kept[1][layer]) and torch.equal(kept[0][layer], kept[2][layer])


def test_a_press_takes_a_request_resolved_once(artifacts):
    """A request resolved once (`kvruntime.resolve_request`) gives its press the method it built and the artifact it
    read; a request of another method, or for a budget (kvpress's presses take a ratio), is refused."""
    scorer, heads = artifacts / "distilled_scorer.safetensors", artifacts / "srh_heads.safetensors"
    options = {"allocation": "uniform", "copy_penalty": 0.0}
    request = kvruntime.resolve_request("distilled", RATIO, artifacts=[scorer], options=options)
    press = DistilledPress.from_request(request)
    assert press.method is request.method and press.artifact is request.artifacts[0]
    assert press.compression_ratio == RATIO
    with pytest.raises(kvruntime.KVRuntimeError, match="^DistilledPress applies distilled, not srh$"):
        DistilledPress.from_request(kvruntime.resolve_request("srh", RATIO, artifacts=[heads]))
    budget = kvruntime.resolve_request("distilled", budget=64, artifacts=[scorer], options=options)
    with pytest.raises(kvruntime.KVRuntimeError, match="takes a compression ratio, not a budget"):
        DistilledPress.from_request(budget)


def test_a_folder_without_the_artifact_and_a_bad_option_are_refused(artifacts, tmp_path):
    with pytest.raises(kvruntime.ArtifactError, match="no distilled_scorer artifact in this folder"):
        DistilledPress.from_artifact(tmp_path)
    with pytest.raises(kvruntime.KVRuntimeError, match="window"):
        DistilledPress.from_artifact(artifacts, window="wide")
    with pytest.raises(kvruntime.KVRuntimeError, match="copy_penalty counts the prompt's token ids"):
        DistilledPress.from_artifact(artifacts, copy_penalty=0.25)
    with pytest.raises(kvruntime.KVRuntimeError, match="kvpress cuts the cache itself and merges nothing"):
        DistilledPress.from_artifact(artifacts, copy_penalty=0.0, merge="values")
    with pytest.raises(kvruntime.KVRuntimeError, match="from_artifact"):
        DistilledPress(compression_ratio=0.5)


@pytest.mark.integration
def test_kvpress_pipeline_answers_the_pass_key_with_the_shipped_distilled_scorer(default_model):
    """kvpress's own pipeline (chat template, context compressed alone, then the question) with the press built from
    the default model's shipped distilled scorer finds the shipped prompt's pass key at ratio 0.5, holding half the
    context's entries."""
    from transformers import pipeline

    from kvcompile.shipped import shipped_folder

    model, tokenizer = default_model
    prompts = shipped_folder("calibration_data") / "prompts"
    context = (prompts / "passkey_2k_context.txt").read_text()
    press = DistilledPress.from_artifact(shipped_folder("artifacts") / "smollm2-135m-instruct", compression_ratio=0.5)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    answer = pipe(context, question="What is the pass key? Answer with the number.", press=press, max_new_tokens=16)
    assert "25613" in answer["answer"]
