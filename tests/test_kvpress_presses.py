"""`kvcompile eval`'s kvpress contestants with the real kvpress (the bench venv: `make test-bench`; skipped where
kvpress is not installed): every compared press runs through the evaluation's prefill and answer path on a tiny
model, holds the cache kvpress's compression ratio asks for, leaves no hook or mask behind, and answers from
what it kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import import_kvpress, save_char_tokenizer
from test_selection_references import eight_head_model

import kvruntime
from kvcompile.evaluation import prefill, runner
from kvcompile.evaluation.contestants import CHECKPOINTS, PRESSES, Press
from kvcompile.evaluation.prefill import press_keep_masks
from kvcompile.recipes.distilled.kvzap_checkpoint import write_kvzap_checkpoint
from kvruntime.methods.distilled import feature_count, predicted_scores, token_features
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.cache_ops import cache_bytes

kvpress = import_kvpress()

LENGTH, RATIO = 160, 0.5
# Presses that hide entries instead of removing them (the runner turns their masks into keep masks).
MASKING = {"kvzip"}
# Presses with hooks or passes of their own, which cannot run on a recorded prefill (`prefill.replays`).
PREFILL_ALONE = {"kvzip", "kvcompose"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """The tiny Llama, named by a folder holding a character tokenizer of its 96 ids: KVzip loads the model's
    tokenizer by name to build its repeat prompt."""
    built = eight_head_model("llama")
    folder = tmp_path_factory.mktemp("tokenizer")
    save_char_tokenizer(folder)
    built.config.name_or_path = str(folder)
    return built


def hidden_only_scorer(model: torch.nn.Module) -> kvruntime.Artifact:
    """A distilled scorer that reads the attention input and the bias only (random weights), as `--student hidden`
    fits one."""
    fingerprint = kvruntime.model_fingerprint(model)
    hidden = model.config.hidden_size
    weights = torch.zeros(fingerprint.num_layers, feature_count(hidden), fingerprint.num_kv_heads)
    weights[:, : hidden + 1] = torch.randn(fingerprint.num_layers, hidden + 1, fingerprint.num_kv_heads)
    return kvruntime.Artifact("distilled_scorer", {"weights": weights}, fingerprint, {}, {"oracle": "kvzip_plus"})


@pytest.fixture(scope="module")
def checkpoints(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    """What the presses that need one are built from: KVzap's checkpoint, and the compiled presses' artifacts."""
    folder = tmp_path_factory.mktemp("artifacts")
    fingerprint = kvruntime.model_fingerprint(model)
    heads = torch.rand(fingerprint.num_layers, fingerprint.num_query_heads, generator=torch.Generator().manual_seed(2))
    srh = kvruntime.Artifact("srh_heads", {"srh_score": heads}, fingerprint, {}, {})
    return {
        "kvzap": [write_kvzap_checkpoint(hidden_only_scorer(model), folder / CHECKPOINTS["kvzap"])],
        "distilled": [kvruntime.save_artifact(hidden_only_scorer(model), folder / "distilled_scorer.safetensors")],
        "srh": [kvruntime.save_artifact(srh, folder / "srh_heads.safetensors")],
    }


@pytest.fixture(scope="module")
def context() -> torch.Tensor:
    return torch.randint(3, 96, (1, LENGTH), generator=torch.Generator().manual_seed(8))


def hook_counts(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def full_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    with torch.no_grad():
        return cache_bytes(model(ids, use_cache=True).past_key_values)


@pytest.mark.parametrize("press", sorted(PRESSES))
def test_every_compared_press_holds_its_ratio_and_leaves_nothing_behind(
    model, context, press, checkpoints, monkeypatch
):
    masks: dict[int, torch.Tensor] = {}

    def keep_masks(*args) -> dict[int, torch.Tensor]:
        masks.update(press_keep_masks(*args))
        return masks

    monkeypatch.setattr(prefill, "press_keep_masks", keep_masks)
    question = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(9))
    hooks = hook_counts(model)
    with torch.no_grad():
        before = model(torch.cat([context, question], dim=1)).logits[0, -1]
    contestant = Press(f"kvpress-{press}", press)
    with contestant.prefilled(model, RATIO, context, checkpoints.get(press, [])) as prefilled:
        output = prefilled.generate(question, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert output.sequences.shape == (1, question.shape[1] + 2)
    # kvpress's ratio is of the context's entries: half of them held. A masking press hides them per head; the
    # bytes held count each layer's densest head (what a dense store of its kept entries would need).
    held = prefilled.cache_bytes / full_bytes(model, context)
    assert bool(masks) == (press in MASKING)
    if masks:
        visible = sum(int(mask.sum()) for mask in masks.values()) / (len(masks) * masks[0].shape[1] * LENGTH)
        assert visible == pytest.approx(1 - RATIO, abs=1 / LENGTH)
        densest = [int(mask.sum(dim=-1).max()) / LENGTH for mask in masks.values()]
        assert held == pytest.approx(sum(densest) / len(densest), abs=1e-6)
    else:
        assert held == pytest.approx(1 - RATIO, abs=1 / LENGTH), held
    # The press's hooks are gone and no module keeps masks: the model is what it was.
    assert hook_counts(model) == hooks
    assert all(getattr(module, "masked_key_indices", None) is None for module in model_layout(model).cut_modules)
    with torch.no_grad():
        after = model(torch.cat([context, question], dim=1)).logits[0, -1]
    torch.testing.assert_close(after, before)


def test_a_press_keeping_everything_answers_as_the_full_cache(model, context):
    """At ratio 0 a press removes nothing: the evaluation's answer path over its cache gives the full model's
    logits, so a difference at a real ratio comes from what the press removed, not from the plumbing."""
    question = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(10))
    with Press("kvpress-snapkv", "snapkv").prefilled(model, 0.0, context, []) as prefilled:
        output = prefilled.generate(
            question, max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    with torch.no_grad():
        full = model(torch.cat([context, question], dim=1)).logits[0, -1]
    torch.testing.assert_close(output.logits[0][0], full, atol=1e-4, rtol=1e-4)


def test_kvpress_loads_an_exported_scorer_and_scores_as_kvruntime_does(model, tmp_path):
    """`kvcompile export-kvzap`'s checkpoint in kvpress's own KVzapModel gives, per layer, the log-scores the
    runtime's distilled method computes from the same scorer on the same attention inputs."""
    from kvpress.presses.kvzap_press import KVzapModel

    scorer = hidden_only_scorer(model)
    loaded = KVzapModel.from_pretrained(write_kvzap_checkpoint(scorer, tmp_path / "kvzap"))
    hidden = torch.randn(1, LENGTH, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    for layer in range(scorer.tensors["weights"].shape[0]):
        ours = predicted_scores(token_features(hidden), scorer.tensors["weights"][layer])
        with torch.no_grad():
            theirs = loaded.layers[layer](hidden).transpose(1, 2)
        torch.testing.assert_close(theirs, ours.float(), rtol=1e-5, atol=1e-5)


def test_a_scorer_reading_position_features_is_not_exported(model, tmp_path):
    scorer = hidden_only_scorer(model)
    scorer.tensors["weights"][:, -1] = 1.0  # likeness to the earlier tokens: KVzap's model cannot read it
    with pytest.raises(kvruntime.KVRuntimeError, match="--student hidden"):
        write_kvzap_checkpoint(scorer, tmp_path / "kvzap")
    assert not (tmp_path / "kvzap").exists()


@pytest.mark.parametrize("press", sorted(PRESSES))
def test_every_compared_press_on_a_shared_prefill_answers_as_on_its_own(model, context, press, checkpoints):
    """`kvcompile eval --shared-prefill`: a press whose work is all in kvpress's forward hook runs it on the recorded
    prefill and holds, answers and scores exactly what its own prefill gives; KVzip, which adds passes of its own,
    prefills alone."""
    question = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(11))
    contestant = Press(f"kvpress-{press}", press)
    scoring = runner.Scoring([7, 3, 9], [11, 12])
    tokenizer = SimpleNamespace(eos_token_id=0, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    arguments = (model, tokenizer, contestant, RATIO, context, question, 4, checkpoints.get(press, []), scoring)
    shared = prefill.shared_prefill(model, context)
    torch.manual_seed(0)  # Compactor sketches its leverage scores with random projections
    own = runner.answer(*arguments)
    torch.manual_seed(0)
    replayed = runner.answer(*arguments, shared)
    assert replayed.tokens == own.tokens and replayed.cache_bytes == own.cache_bytes
    assert torch.equal(replayed.first_logits, own.first_logits)
    assert torch.equal(replayed.reference_logits, own.reference_logits)
    assert (replayed.peak_mib is None) == (press not in PREFILL_ALONE)  # measured where it prefilled alone
