"""A hybrid cache (issue #62): tiny Gemma 3, OLMo 3, Gemma 2 (soft-capped logits) and gpt-oss (attention sinks)
models whose sliding-window layers (window 16) sit between full-attention ones. Only the full-attention layers are
cut; each sliding layer holds exactly what the plain prefill leaves in it; the report says what was compressible and
what was left, in bytes; nothing kept, nothing changed: a context kept whole answers as the plain model does;
streamed, the cache held stays bounded; what cannot apply (batches, quantized caches) is refused in one line. Which
entries each method keeps on a hybrid cache is test_selection_references.py's (its gemma3_text and gemma2 models)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

import kvruntime
from kvruntime.errors import KVRuntimeError
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.cache_ops import cache_argument

HYBRIDS = ["gemma3_text", "olmo3", "gemma2", "gpt_oss"]
GREEDY = dict(do_sample=False, max_new_tokens=8, pad_token_id=0)


@pytest.fixture(params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_model(request.param)


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(7))


def plain_cache(model: torch.nn.Module, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_argument(model, cache), use_cache=True)
    return cache


@pytest.mark.parametrize("method, options", [("snapkv", {}), ("kvcompress", {}), ("kvcompose", {"mode": "dynamic"})])
def test_only_the_full_attention_layers_are_cut_and_the_report_says_so(hybrid, prompt, method, options):
    plain = plain_cache(hybrid, prompt)
    with kvruntime.compress(hybrid, method, ratio=0.5, options=options) as session:
        context = session.prefill(prompt)
    report, cache = context.report, context.cache
    growing = list(model_layout(hybrid).cut_layers)
    sliding = list(model_layout(hybrid).sliding_layers)
    assert sliding and growing and sorted(sliding + growing) == list(range(hybrid.config.num_hidden_layers))
    assert report.layers == growing and report.bounded_layers == sliding
    for index in sliding:  # as the plain prefill left it (a second pass moved it on, and it was put back)
        assert torch.equal(cache.layers[index].keys, plain.layers[index].keys)
        assert cache.layers[index].keys.shape[2] == 15  # the window's last 15 entries: what the model keeps
    assert [cache.layers[index].keys.shape[2] for index in growing] == report.slots_per_layer
    assert sum(report.slots_per_layer) == 45 * len(growing)  # half of what the full-attention layers held
    per_entry = 2 * plain.layers[0].keys[..., :1, :].numel() * 4  # keys and values, float32
    assert report.bounded_bytes == len(sliding) * 15 * per_entry  # the window's storage alone, not the prompt's
    assert report.bytes_before == (len(sliding) * 15 + len(growing) * 90) * per_entry
    assert report.bytes_after == (len(sliding) * 15 + len(growing) * 45) * per_entry
    assert report.entries_removed_fraction == pytest.approx(0.5)  # of the full-attention layers' entries
    text = str(report)
    assert f"sliding layers      {len(sliding)} (" in text and f"ratio is of the {len(growing)} full-attention" in text


def test_a_context_kept_whole_answers_as_the_plain_model_does(hybrid, prompt):
    """Nothing cut: kvruntime's attention (its sliding band at the prefill, the question and every decoding step)
    and question mode give the plain model's greedy answer, token for token."""
    question = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = hybrid.generate(torch.cat([prompt, question], dim=1), **GREEDY)[:, prompt.shape[1] :]
    with kvruntime.compress(hybrid, "snapkv", budget=prompt.shape[1]) as session:
        got = session.prefill(prompt).generate(question, **GREEDY)
    assert torch.equal(got, expected)


def test_a_prefills_peak_holds_each_sliding_layer_at_its_window_counted_by_hand(hybrid, prompt):
    """A prefill of one piece, its full-attention layers cut to half inside it once each has attended (snapkv's
    budgets are known in advance): the peak, measured as the last of them has attended, is the earlier ones' halves,
    its whole prompt and each sliding layer's window alone, its storage trimmed once it has attended (trimmed before,
    it would hold the prompt's until the next forward)."""
    with kvruntime.compress(hybrid, "snapkv", ratio=0.5) as session:
        report = session.prefill(prompt).report
    per_entry = 2 * hybrid.config.num_key_value_heads * hybrid.config.head_dim * 4  # keys and values, float32
    full, sliding = len(report.layers), len(report.bounded_layers)
    assert report.peak_bytes == ((full - 1) * 45 + 90 + sliding * 15) * per_entry


def test_a_streamed_prefill_holds_the_budgets_plus_one_chunk_and_the_windows(hybrid):
    prompt = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(9))
    with kvruntime.compress(hybrid, "snapkv", budget=40, prefill_chunk_size=32) as session:
        context = session.prefill(prompt)
    report = context.report
    per_entry = report.bytes_before // (len(report.bounded_layers) * 15 + len(report.layers) * 200)
    assert report.slots_per_layer == [40] * len(report.layers) and "chunks" in report.cut
    # At most: every growing layer at its budget plus one chunk, every sliding one its window and one chunk.
    bound = (len(report.layers) * (40 + 32) + len(report.bounded_layers) * (15 + 32)) * per_entry
    assert report.peak_bytes <= bound


def test_what_cannot_apply_to_a_hybrid_cache_is_refused_in_one_line(hybrid, prompt):
    batch = torch.cat([prompt, prompt.flip(1)])
    with pytest.raises(KVRuntimeError, match="a batch .* on a model with sliding-window layers: give the prompts"):
        with kvruntime.compress(hybrid, "snapkv", ratio=0.5) as session:
            session.prefill(batch)
    with pytest.raises(KVRuntimeError, match="kv_bits .* not on a model with sliding-window layers"):
        with kvruntime.compress(hybrid, "snapkv", ratio=0.5, kv_bits=8):
            pass


def test_kvcompile_tables_compiles_for_a_hybrid_model_and_the_runtime_applies_them(
    tmp_path, monkeypatch, short_cql_fits
):
    """The rollouts call the model's own decoder layers as its forward does, sliding ones included: the tables
    cover the full-attention layers (one row each) and the compilerkv method runs with them."""
    from conftest import CharTokenizer
    from typer.testing import CliRunner

    from kvcompile import recipe
    from kvcompile.cli import app

    model = tiny_model("gemma3_text")
    monkeypatch.setattr(recipe, "load_model", lambda name, **_: (model, CharTokenizer()))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("".join(chr(97 + (j * j * 13) % 26) for j in range(6000)))
    small = [
        "--budgets",
        "80",
        "--prompts",
        "2",
        "--candidates",
        "3",
        "--context-tokens",
        "160",
        "--continuation",
        "12",
    ]
    result = CliRunner().invoke(
        app, ["tables", *small, "--rounds", "1", "--corpus", "corpus.txt", "--out", "t.safetensors"]
    )
    assert result.exit_code == 0, result.output
    tables = kvruntime.load_artifact(tmp_path / "t.safetensors", model=model, kind="compilerkv_tables")
    assert tables.tensors["head_reliability"].shape == (1, len(model_layout(model).cut_modules), 4)
    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(3))
    with kvruntime.compress(model, "compilerkv", budget=80, artifacts=[tmp_path / "t.safetensors"]) as session:
        session.prefill(ids)
    assert session.report.layers == [1, 3] and session.report.bounded_layers == [0, 2]


def test_a_kvzap_checkpoint_of_the_cut_layers_sits_at_their_indices_where_kvpress_looks():
    """A checkpoint has a module per full-attention layer (as kvcompile's artifacts have rows); kvpress looks a
    layer's module up by the layer's index, so they go to 0 and 2 here, and a sliding layer's (the last one's too)
    refuses to score."""
    from conftest import HYBRID, TINY
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvcompile.evaluation.contestants import at_model_layers

    kinds = ["full_attention", "sliding_attention"] * 2
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**TINY, **HYBRID, "layer_types": kinds}))
    first, second = torch.nn.Linear(64, 2), torch.nn.Linear(64, 2)
    placed = at_model_layers(model, torch.nn.ModuleList([first, second]))
    assert len(placed) == 4 and placed[0] is first and placed[2] is second
    for sliding in (1, 3):
        with pytest.raises(KVRuntimeError, match="no scorer for a sliding-window layer"):
            placed[sliding](torch.zeros(1, 3, 64))
    with pytest.raises(KVRuntimeError, match="has 3 layers, the model 2 to cut"):
        at_model_layers(model, torch.nn.ModuleList([first, second, first]))


def test_the_capability_check_reads_the_attention_calls_in_transformers_source():
    """Gemma 2 runs its attention eagerly with a soft cap, which kvruntime's attention function implements: accepted
    from its config alone; so are gpt-oss's attention sinks (`s_aux`). BLOOM computes its attention itself:
    refused, naming why."""
    from kvruntime.errors import UnsupportedModelError
    from kvruntime.models.model_spec import _modeling_source, attention_call_keywords, check_config_compressible

    assert attention_call_keywords(_modeling_source("gemma2")) == {"dropout", "scaling", "sliding_window", "softcap"}
    assert "s_aux" in attention_call_keywords(_modeling_source("gpt_oss"))
    kinds = ["sliding_attention", "full_attention"]
    check_config_compressible({"model_type": "gemma2", "num_hidden_layers": 2, "layer_types": kinds})
    check_config_compressible({"model_type": "gpt_oss", "num_hidden_layers": 2, "layer_types": kinds})
    with pytest.raises(UnsupportedModelError, match=r"'bloom' does not run its attention .*\(logit soft-capping, "):
        check_config_compressible({"model_type": "bloom", "num_hidden_layers": 2})
