"""The compresskv family at runtime, on tiny models with hand-made artifacts."""

import pytest
import torch
from conftest import tiny_model

import kvruntime
from kvruntime.artifacts.artifact import Artifact, save_artifact
from kvruntime.artifacts.fingerprint import model_fingerprint
from kvruntime.errors import ArtifactError, KVRuntimeError
from kvruntime.math.allocation import error_aware_budgets

LAYER_ERROR = torch.tensor([0.1, 0.4, 0.2, 0.3])


@pytest.fixture
def compiled(tiny, tmp_path):
    """srh_heads and layer_budgets artifacts for the tiny model (4 layers, 4 query heads, 2 KV heads)."""
    fingerprint = model_fingerprint(tiny)
    heads = torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    common = dict(model=fingerprint, provenance={"command": "test"})
    paths = [
        save_artifact(
            Artifact(kind="srh_heads", tensors={"srh_score": heads, "retrieval_score": heads.flip(1)}, **common),
            tmp_path / "srh_heads.safetensors",
        ),
        save_artifact(
            Artifact(kind="layer_budgets", tensors={"layer_error": LAYER_ERROR}, **common),
            tmp_path / "layer_budgets.safetensors",
        ),
    ]
    return paths


def test_compresskv_keeps_the_algorithm_1_budget_in_each_layer(tiny, tokens, compiled):
    with kvruntime.compress(tiny, "compresskv", budget=40, artifacts=compiled) as session:
        session.prefill(tokens)
    expected = error_aware_budgets(LAYER_ERROR.tolist(), 40, length=80)
    assert sum(expected) == 4 * 40 and max(expected) <= 80  # the 80-token prompt caps a layer; the others take the rest
    assert session.report.slots_per_layer == expected
    assert session.report.entries_removed_fraction == 0.5
    assert session.report.method == "compresskv"


def test_srh_selection_shares_one_index_set_across_the_kv_heads(tiny, tokens, compiled):
    with kvruntime.compress(tiny, "srh", ratio=0.5, artifacts=compiled) as session:
        session.prefill(tokens)
    assert session.report.slots_per_layer == [40] * 4  # uniform budgets without the layer_budgets part
    for positions in session.kept_positions:
        assert torch.equal(positions[:, 0], positions[:, 1])
        assert positions[0, 0, -8:].tolist() == list(range(72, 80))  # the 8-token window is kept


def test_budgets_compose_with_another_selection(tiny, tokens, compiled):
    with kvruntime.compress(tiny, "snapkv+error-aware", budget=40, artifacts=compiled) as session:
        session.prefill(tokens)
    assert session.report.method == "snapkv+error-aware"
    assert session.report.slots_per_layer == error_aware_budgets(LAYER_ERROR.tolist(), 40, length=80)
    assert session.report.entries_removed_fraction == 0.5


def test_compresskv_generation_runs_and_ratio_zero_is_exact(tiny, tokens, compiled):
    greedy = dict(do_sample=False, max_new_tokens=5, pad_token_id=0)
    expected = tiny.generate(tokens, **greedy)
    with kvruntime.compress(tiny, "compresskv", ratio=0.0, artifacts=compiled):
        assert torch.equal(tiny.generate(tokens, **greedy), expected)


def test_missing_artifact_is_named(tiny, compiled):
    with pytest.raises(KVRuntimeError, match="needs a layer_budgets artifact.*kvcompile layer-errors"):
        with kvruntime.compress(tiny, "compresskv", ratio=0.5, artifacts=compiled[:1]):
            pass


def test_heads_artifact_of_another_model_is_refused(tiny, compiled):
    retrained = tiny_model(tiny.config.model_type, seed=7)
    with pytest.raises(ArtifactError, match="another checkpoint"):
        with kvruntime.compress(retrained, "srh", ratio=0.5, artifacts=compiled[:1]):
            pass
