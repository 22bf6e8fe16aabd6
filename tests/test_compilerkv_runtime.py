"""The compilerkv method at runtime, on tiny models with hand-made tables, against an eager-attention reference."""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

import kvruntime
from kvruntime.artifact import Artifact, save_artifact
from kvruntime.errors import ArtifactError, KVRuntimeError
from kvruntime.fingerprint import model_fingerprint
from kvruntime.methods import Prefill

BUDGETS = (70, 100)
ENTROPY_EDGES = torch.tensor([4.0, 4.5], dtype=torch.float64)
PERPLEXITY_EDGES = torch.tensor([90.0], dtype=torch.float64)


def _tensors(layers: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "budgets": torch.tensor(BUDGETS),
        "head_reliability": 0.8 + 0.7 * torch.rand(2, layers, 4, generator=g),
        "risk_thresholds": 0.8 + 0.2 * torch.rand(2, layers, 3, 2, generator=g),
        "entropy_edges": ENTROPY_EDGES,
        "perplexity_edges": PERPLEXITY_EDGES,
    }


@pytest.fixture
def tables(tiny, tmp_path):
    artifact = Artifact("compilerkv_tables", _tensors(), model_fingerprint(tiny), {"command": "test"})
    return save_artifact(artifact, tmp_path / "compilerkv_tables.safetensors")


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(5))


def _reference_kept(model, ids, budget_index, uniform_heads=False, fixed_threshold=None) -> list[torch.Tensor]:
    """The spec's selection computed from full eager attention maps: alpha from the last 64 query rows of every
    layer and head, rho from the cached values, entropy and window perplexity, then gate and top-k per layer."""
    t = _tensors()
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, output_attentions=True)
    model.set_attn_implementation("sdpa")
    n, w = ids.shape[1], 64
    rows = torch.cat([a[0, :, -w:, :] for a in out.attentions])  # [L * Hq, w, n]
    alpha = (n / w) * rows.double().mean(dim=0).sum(dim=0)
    p = alpha / alpha.sum()
    entropy = float(-(p * p.log()).sum())
    logprobs = out.logits[0, -w:-1].double().log_softmax(-1).gather(-1, ids[0, -w + 1 :, None])
    perplexity = float((-logprobs.mean()).exp())
    e_bin = int((ENTROPY_EDGES <= entropy).sum())
    p_bin = int((PERPLEXITY_EDGES <= perplexity).sum())
    kept = []
    for layer, cached in enumerate(cache.layers):
        norms = cached.values[0].double().norm(dim=-1)  # [Hkv, n]
        rho = norms / norms.mean(dim=-1, keepdim=True)
        weights = torch.ones(4) if uniform_heads else t["head_reliability"][budget_index, layer]
        scores = torch.stack([weights[h] * alpha * rho[h // 2] for h in range(4)]).amax(dim=0)
        scores[-w:] = float("inf")
        threshold = fixed_threshold or float(t["risk_thresholds"][budget_index, layer, e_bin, p_bin])
        count = min(BUDGETS[budget_index], int((scores >= threshold).sum()))
        kept.append(scores.topk(count).indices.sort().values)
    return kept


@pytest.mark.parametrize("options", [{}, {"uniform_heads": True}, {"fixed_threshold": 0.9}])
@pytest.mark.parametrize("budget_index", [0, 1])
def test_kept_entries_match_the_specs_selection_from_eager_attention(tiny, tables, prompt, budget_index, options):
    expected = _reference_kept(tiny, prompt, budget_index, **options)
    with kvruntime.compress(
        tiny, "compilerkv", budget=BUDGETS[budget_index], artifacts=[tables], options=options
    ) as session:
        session.prefill(prompt)
    for layer, indices in enumerate(expected):
        for kv_head in range(2):  # one index set per layer, shared by its KV heads
            assert session.kept_positions[layer][0, kv_head].tolist() == indices.tolist()
    assert session.report.slots_per_layer == [len(k) for k in expected]
    assert all(len(k) <= BUDGETS[budget_index] for k in expected)


def test_the_gate_is_elastic_a_layer_may_keep_fewer_entries_than_the_budget(tables):
    """Attention mass on a few tokens (as in real models; a random one attends almost uniformly): the gate admits
    the window and those few, fewer than the budget, and the layer keeps just them."""
    method = kvruntime.get_method("compilerkv", [kvruntime.read_artifact(tables)], {"fixed_threshold": 0.9})
    length = 200
    mass = torch.full((1, length), 0.1 / length)
    mass[0, [3, 50, 77]] = 0.3  # three heavy hitters outside the 64-token window
    statistics = [(mass, torch.ones(1, 2, length)) for _ in range(4)]
    prefill = Prefill(
        length=length,
        num_kv_heads=2,
        input_ids=torch.randint(0, 96, (1, length)),
        hidden_states=torch.randn(1, length, 8),
        output_embeddings=torch.nn.Linear(8, 96),
        second_pass_attention=list,
    )
    with torch.no_grad():  # as the engine calls it
        selection = method.select(statistics, kvruntime.Request(budget=100), prefill)
    assert selection.counts.tolist() == [[67, 67]] * 4  # the window and the three, not the budget of 100
    top = selection.scores[0][0, 0].topk(67).indices
    assert {3, 50, 77} <= set(top.tolist())


def test_generation_and_questions_run_on_the_compressed_cache(tiny, tables, prompt):
    with kvruntime.compress(tiny, "compilerkv", budget=100, artifacts=[tables]) as session:
        generated = tiny.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        context = session.prefill(prompt)
        answer = context.generate(prompt[:, :7], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 165)
    assert answer.shape == (1, 10)


def test_a_budget_that_was_not_compiled_is_refused_unless_the_nearest_is_asked_for(tiny, tables, prompt):
    with pytest.raises(KVRuntimeError, match="compiled for budgets 70, 100 tokens per layer, not 90"):
        with kvruntime.compress(tiny, "compilerkv", budget=90, artifacts=[tables]):
            pass
    with kvruntime.compress(
        tiny, "compilerkv", budget=90, artifacts=[tables], options={"nearest_budget": True}
    ) as session:
        session.prefill(prompt)
    assert max(session.report.slots_per_layer) <= 90
    assert "tables of compiled budget 100" in str(session.report)


def test_method_options_are_checked(tiny, tables):
    with pytest.raises(KVRuntimeError, match="unknown compilerkv options"):
        kvruntime.get_method("compilerkv", [kvruntime.read_artifact(tables)], {"budget_nearest": True})
    with pytest.raises(KVRuntimeError, match="takes no options"):
        kvruntime.get_method("snapkv", [], {"nearest_budget": True})
    with pytest.raises(KVRuntimeError, match="unknown method 'compilerkv\\+budgets'"):
        kvruntime.get_method("compilerkv+budgets", [])
    with pytest.raises(KVRuntimeError, match="needs a compilerkv_tables artifact"):
        kvruntime.get_method("compilerkv", [])


def test_tables_of_another_layer_count_need_force_and_are_interpolated_over_depth(tiny, tmp_path, prompt):
    deeper = dataclasses.replace(model_fingerprint(tiny), num_layers=7)
    path = save_artifact(
        Artifact("compilerkv_tables", _tensors(layers=7), deeper, {"command": "test"}), tmp_path / "t.safetensors"
    )
    with pytest.raises(ArtifactError, match="with 7 layers, the model .* with 4; pass force=True"):
        kvruntime.load_artifact(path, model=tiny)
    with pytest.warns(UserWarning, match="applied by relative depth"):
        with kvruntime.compress(tiny, "compilerkv", budget=100, artifacts=[path], force=True) as session:
            session.prefill(prompt)
    assert len(session.report.slots_per_layer) == 4
    other_heads = dataclasses.replace(model_fingerprint(tiny), num_query_heads=8)
    path = save_artifact(
        Artifact("compilerkv_tables", _tensors(), other_heads, {"command": "test"}), tmp_path / "h.safetensors"
    )
    with pytest.raises(ArtifactError, match="num_query_heads: 8 vs 4"):
        kvruntime.load_artifact(path, model=tiny, force=True)
