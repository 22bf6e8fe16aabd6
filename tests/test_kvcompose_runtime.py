"""`kvcompose` in the runtime on tiny models: the scoring pass and the window scores against eager attention, the
composite-token layout, the compiled allocation (freed bytes, shares) and the refusals."""

import pytest
import torch
from conftest import CharTokenizer, dynamic_layer_shares, tiny_model
from transformers import DynamicCache

import kvruntime
from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.calibration.job import CompileJob
from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvruntime.artifacts.artifact import save_artifact
from kvruntime.errors import ArtifactError, KVRuntimeError
from kvruntime.math.allocation import apportion
from kvruntime.math.composite_tokens import composite_curve, kv_head_scores, layer_allocation
from kvruntime.math.selection import protect_window
from kvruntime.methods.kvcompose.stats import KVComposeStats
from kvruntime.plumbing.second_pass import task_attention_maxima
from kvruntime.requests.request import kept_per_head

CORPUS = Corpus("synthetic", tuple("".join(chr(97 + (i * 5 + j * j * 11) % 26) for j in range(6000)) for i in range(3)))
SETTINGS = StatsSettings(ratios=(0.25, 0.5, 0.75), prompts=3, prompt_tokens=160)


@pytest.fixture(scope="module")
def stats_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("kvcompose") / "kvcompose_stats.safetensors"
    artifact = compile_attention_stats(CompileJob(tiny_model("llama"), CharTokenizer(), out), CORPUS, SETTINGS)
    return save_artifact(artifact, out)


def _prompt(length: int = 160) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(3))


def _eager_attentions(model: torch.nn.Module, ids: torch.Tensor) -> tuple:
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")


def _top_positions(scores: torch.Tensor, count: int) -> list[list[int]]:
    return [sorted(scores[h].topk(count).indices.tolist()) for h in range(scores.shape[0])]


@pytest.mark.parametrize("chunk", [7, 512])
def test_the_scoring_pass_gives_the_eager_attention_of_the_prompt_fed_after_itself_and_restores_the_cache(
    tiny, tokens, chunk
):
    length = tokens.shape[1]
    cache = DynamicCache(config=tiny.config)
    with torch.no_grad():
        tiny(tokens, past_key_values=cache, use_cache=True)
    before = [layer.keys.clone() for layer in cache.layers]
    maxima = task_attention_maxima(tiny, cache, tokens, length, chunk=chunk)
    attentions = _eager_attentions(tiny, torch.cat([tokens, tokens], dim=1))
    for layer, task_max in enumerate(maxima):
        expected = attentions[layer][:, :, length:, :length].amax(dim=-2)
        assert torch.allclose(task_max, expected, atol=1e-5)
        assert torch.equal(cache.layers[layer].keys, before[layer])


def test_dynamic_mode_keeps_each_heads_own_best_tokens_in_the_papers_layer_allocation(tiny):
    ids = _prompt()
    length = ids.shape[1]
    attentions = _eager_attentions(tiny, torch.cat([ids, ids], dim=1))
    scores = [kv_head_scores(a[:, :, length:, :length].amax(dim=-2), 2)[0] for a in attentions]
    keep = kept_per_head(length, 32, ratio=0.5)
    expected = layer_allocation(torch.stack([composite_curve(s[None])[0] for s in scores]), keep * len(scores))
    with kvruntime.compress(tiny, "kvcompose", ratio=0.5, options={"mode": "dynamic"}) as session:
        session.prefill(ids)
    report = session.report
    assert report.slots_per_layer == expected.tolist()
    assert abs(report.entries_removed_fraction - 0.5) < 1e-9
    composite = False
    for layer, positions in enumerate(session.kept_positions):
        assert positions[0].tolist() == _top_positions(scores[layer], int(expected[layer]))
        composite |= positions[0, 0].tolist() != positions[0, 1].tolist()
    assert composite, "every layer's heads kept the same tokens: no composite tokens were formed"


def test_compiled_mode_scores_tokens_by_window_attention_and_frees_the_requested_ratio(stats_path):
    model = tiny_model("llama")
    ids = _prompt()
    length = ids.shape[1]
    attentions = _eager_attentions(model, ids)
    stats = KVComposeStats.from_artifact(kvruntime.load_artifact(stats_path))
    for ratio in (0.25, 0.5, 0.625, 0.75):
        with kvruntime.compress(model, "kvcompose", ratio=ratio, artifacts=[stats_path]) as session:
            session.prefill(ids)
        report = session.report
        keep = kept_per_head(length, 32, ratio=ratio)
        shares, _ = stats.fractions(1 - keep / length, per_head=False)
        expected = apportion(shares, keep * 4, 32, length)
        assert report.slots_per_layer == expected.tolist()
        freed = 1 - report.bytes_after / report.bytes_before
        assert abs(freed - ratio) < 0.01, (ratio, freed)
        for layer, positions in enumerate(session.kept_positions):
            window = attentions[layer][:, :, -32:, :]  # the last 32 queries over the whole prompt
            scores = protect_window(kv_head_scores(window.amax(dim=-2), 2), 32)[0]
            assert positions[0].tolist() == _top_positions(scores, int(expected[layer]))


def test_compiled_mode_says_how_the_shares_were_obtained(stats_path):
    model = tiny_model("llama")
    with kvruntime.compress(model, "kvcompose", ratio=0.625, artifacts=[stats_path]) as session:
        session.prefill(_prompt())
    assert "compiled allocation (task-agnostic stats, interpolated between compiled ratios 0.5 and 0.75)" in str(
        session.report
    )
    assert "composite tokens" in str(session.report)


def test_the_compiled_allocation_is_the_dynamic_allocation_averaged_over_the_calibration_prompts(stats_path):
    model = tiny_model("llama")
    artifact = kvruntime.load_artifact(stats_path)
    prompts = calibration_prompts(CORPUS, CharTokenizer(), SETTINGS.prompts, SETTINGS.prompt_tokens, SETTINGS.seed)
    for index, ratio in enumerate(SETTINGS.ratios):
        compiled = artifact.tensors["layer_fractions"][index].double()
        assert torch.allclose(dynamic_layer_shares(model, prompts, ratio), compiled, atol=1e-6), ratio


def test_unstructured_variant_keeps_per_head_counts_masked(stats_path):
    model = tiny_model("llama")
    ids = _prompt()
    with pytest.raises(KVRuntimeError, match="use memory='masked'"):
        kvruntime.compress(
            model, "kvcompose", ratio=0.5, options={"unstructured": True}, artifacts=[stats_path]
        ).__enter__()
    for options in ({"unstructured": True}, {"unstructured": True, "mode": "dynamic"}):
        with kvruntime.compress(
            model, "kvcompose", ratio=0.5, memory="masked", options=options, artifacts=[stats_path]
        ) as session:
            output = model.generate(ids, max_new_tokens=4, do_sample=False)
        report = session.report
        assert output.shape[1] == ids.shape[1] + 4
        assert abs(report.entries_removed_fraction - 0.5) < 1e-9
        assert "per-head counts, masked" in str(report)


def test_bad_kvcompose_requests_are_refused_with_clear_messages(stats_path, tmp_path):
    model = tiny_model("llama")
    with pytest.raises(KVRuntimeError, match=r"ratio 0.9 is outside the compiled ratios .*\(0.25 to 0.75"):
        kvruntime.compress(model, "kvcompose", ratio=0.9, artifacts=[stats_path]).__enter__()
    with pytest.raises(KVRuntimeError, match="needs a kvcompose_stats artifact for this model .*kvcompile stats"):
        kvruntime.compress(model, "kvcompose", ratio=0.5).__enter__()
    with pytest.raises(KVRuntimeError, match="unknown kvcompose mode 'fast'"):
        kvruntime.compress(model, "kvcompose", ratio=0.5, options={"mode": "fast"}, artifacts=[stats_path]).__enter__()
    with pytest.raises(KVRuntimeError, match=r"unknown kvcompose options \['kernel'\]"):
        kvruntime.compress(model, "kvcompose", ratio=0.5, options={"kernel": 8}).__enter__()
    with pytest.raises(ArtifactError, match="compiled for another model"):  # another architecture: even with force
        kvruntime.compress(tiny_model("qwen2"), "kvcompose", ratio=0.5, artifacts=[stats_path], force=True).__enter__()
    with pytest.raises(KVRuntimeError, match="compiled ratios"):  # a budget is checked once the prompt length is known
        with kvruntime.compress(model, "kvcompose", budget=8, artifacts=[stats_path]) as session:
            session.prefill(_prompt(40))
