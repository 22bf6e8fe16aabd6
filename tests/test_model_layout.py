"""One owner of what the runtime knows about a model (`kvruntime.models.layout`): nothing else reads a config's layer
kinds or a cache layer's window; its two layer numberings map onto each other; and its logits are the model's own,
so that CompilerKV's log-probabilities at run time are those its tables were compiled from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_compilerkv_runtime import BUDGETS, save_tables

import kvruntime
import kvruntime.methods.compilerkv.method as compilerkv_method
from kvcompile.recipes.compilerkv.experience_collection import prefill_with_signals
from kvruntime.methods.compilerkv.risk_gate import semantic_risk
from kvruntime.models.layout import model_layout

ROOT = Path(__file__).resolve().parents[1]
# What only the model package (and the attention function, which receives the model's window) may name: the
# config's layer kinds and text part, a cache layer's kind and window.
MODEL_FACTS = re.compile(r"\b(is_sliding|layer_types|sliding_window|text_config)\b")
OWNERS = (ROOT / "runtime" / "kvruntime" / "models", ROOT / "runtime" / "kvruntime" / "plumbing" / "attention.py")


def test_only_the_model_package_reads_layer_kinds_windows_and_the_text_config():
    sources = [*(ROOT / "runtime" / "kvruntime").rglob("*.py"), *(ROOT / "kvcompile").rglob("*.py")]
    readers = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sources
        if not any(path == owner or owner in path.parents for owner in OWNERS)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if MODEL_FACTS.search(line)
    ]
    assert readers == []


@pytest.mark.parametrize(
    "kind, cut, sliding", [("llama", (0, 1, 2, 3), ()), ("gemma3_text", (1, 3), (0, 2)), ("olmo3", (3,), (0, 1, 2))]
)
def test_the_layout_numbers_the_cut_layers_from_the_configs_layer_kinds(kind, cut, sliding):
    model = tiny_model(kind)
    layout = model_layout(model)
    assert (layout.cut_layers, layout.sliding_layers) == (cut, sliding)
    assert [module.layer_idx for module in layout.cut_modules] == list(cut)
    assert [module.layer_idx for module in layout.sliding_modules] == list(sliding)
    assert [layout.cut_position(layer) for layer in cut] == list(range(len(cut)))
    assert [layer.self_attn for layer in layout.decoder_layers] == list(layout.attention)
    assert model_layout(model) is layout  # built once per model


# Models whose forward turns its final hidden states into logits with more than the output embedding.
LOGIT_TRANSFORMS = [("gemma3_text", {"final_logit_softcapping": 2.0}), ("granite", {"logits_scaling": 4.0})]


def _transformed(kind: str, settings: dict) -> torch.nn.Module:
    model = tiny_model(kind)
    for key, value in settings.items():
        setattr(model.config, key, value)
    return model


@pytest.mark.parametrize("kind, settings", LOGIT_TRANSFORMS)
def test_the_layouts_logits_are_the_models_own(kind, settings):
    model = _transformed(kind, settings)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model.base_model(ids).last_hidden_state
        expected = model(ids).logits.float()
        plain = model.get_output_embeddings()(hidden).float()
    assert not torch.allclose(plain, expected, atol=1e-3)  # the transform matters on this model
    torch.testing.assert_close(model_layout(model).output_logits(model.get_output_embeddings(), hidden), expected)


@pytest.mark.parametrize("kind, settings", LOGIT_TRANSFORMS)
def test_compilerkv_reads_the_same_window_log_probabilities_at_run_time_as_at_compile_time(
    kind, settings, tmp_path, monkeypatch
):
    """The risk gate's perplexity bins were compiled from the model's logits (its forward, soft cap included); the
    runtime reads the log-probabilities of the same window from the prefill's hidden states."""
    model = _transformed(kind, settings)
    ids = torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(5))
    compiled, _, _ = prefill_with_signals(model, ids, ids.shape[1])
    seen = []

    def recorded(statistics: list, logprobs: torch.Tensor) -> object:
        seen.append(logprobs)
        return signals_of(statistics, logprobs)

    signals_of = compilerkv_method.prompt_signals
    monkeypatch.setattr(compilerkv_method, "prompt_signals", recorded)
    with kvruntime.compress(model, "compilerkv", budget=BUDGETS[0], artifacts=[save_tables(model, tmp_path)]) as s:
        s.prefill(ids)
    assert len(seen) == 1
    assert semantic_risk(seen[0][0]) == pytest.approx(compiled.perplexity, rel=1e-5)
