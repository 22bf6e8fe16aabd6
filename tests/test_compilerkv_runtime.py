"""The compilerkv method at runtime, on tiny models with hand-made tables, against an eager-attention reference."""

import dataclasses

import pytest
import torch
from test_engine import answer_and_reference
from transformers import DynamicCache

import kvruntime
from kvruntime.artifacts.artifact import Artifact, save_artifact
from kvruntime.artifacts.fingerprint import model_fingerprint
from kvruntime.errors import ArtifactError, KVRuntimeError
from kvruntime.methods import CompilerKV, PrefillResult, get_method
from kvruntime.methods.compilerkv import CompilerKVTables
from kvruntime.methods.compilerkv.signals import LayerSignals
from kvruntime.models.layout import model_layout

BUDGETS = (70, 100)
ENTROPY_EDGES = torch.tensor([4.0, 4.5], dtype=torch.float64)
PERPLEXITY_EDGES = torch.tensor([90.0], dtype=torch.float64)


def table_tensors(layers: int = 4, query_heads: int = 4) -> dict[str, torch.Tensor]:
    """Random tables over the whole value range, for `layers` layers of `query_heads` query heads."""
    g = torch.Generator().manual_seed(3)
    return {
        "budgets": torch.tensor(BUDGETS),
        "head_reliability": 0.8 + 0.7 * torch.rand(2, layers, query_heads, generator=g),
        "risk_thresholds": 0.8 + 0.2 * torch.rand(2, layers, 3, 2, generator=g),
        "entropy_edges": ENTROPY_EDGES,
        "perplexity_edges": PERPLEXITY_EDGES,
    }


def save_tables(model, folder, **params):
    tensors = table_tensors(model_fingerprint(model).num_layers, model.config.num_attention_heads)
    artifact = Artifact("compilerkv_tables", tensors, model_fingerprint(model), {"command": "test"}, params)
    return save_artifact(artifact, folder / "compilerkv_tables.safetensors")


@pytest.fixture
def tables(tiny, tmp_path):
    return save_tables(tiny, tmp_path)


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(5))


def reference_kept(
    model, ids, budget_index, uniform_heads=False, fixed_threshold=None, elastic=False, utility="global"
) -> list[torch.Tensor]:
    """The spec's selection computed from full eager attention maps: alpha from the last 64 query rows of every
    layer and head, rho from the cached values, entropy and window perplexity, thresholds from the bins. The
    head-aware utility replaces alpha by the mean of alpha and the head's own window attention times n / w. Weights
    count relative to the layer's largest. Elastic:
    each layer keeps its tokens at or above its threshold, at most the budget. Ratio-honest: the layers share
    budget x layers entries, ranked by score over their layer's threshold (ties: earlier layer, earlier token)."""
    query_heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    growing = list(model_layout(model).cut_layers)  # what the runtime cuts (no sliding layer)
    t = table_tensors(len(growing), query_heads)
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, output_attentions=True)
    model.set_attn_implementation(implementation)
    n, w = ids.shape[1], 64
    rows = torch.cat([out.attentions[index][0, :, -w:, :] for index in growing])  # [L * Hq, w, n]
    alpha = (n / w) * rows.double().mean(dim=0).sum(dim=0)
    p = alpha / alpha.sum()
    entropy = float(-(p * p.log()).sum())
    logprobs = out.logits[0, -w:-1].double().log_softmax(-1).gather(-1, ids[0, -w + 1 :, None])
    perplexity = float((-logprobs.mean()).exp())
    e_bin = int((ENTROPY_EDGES <= entropy).sum())
    p_bin = int((PERPLEXITY_EDGES <= perplexity).sum())
    budget = BUDGETS[budget_index]
    scores, thresholds = [], []
    for layer, index in enumerate(growing):
        norms = cache.layers[index].values[0].double().norm(dim=-1)  # [Hkv, n]
        rho = norms / norms.mean(dim=-1, keepdim=True)
        weights = torch.ones(query_heads) if uniform_heads else t["head_reliability"][budget_index, layer]
        weights = weights / weights.max()  # relative to the layer's largest weight
        own = (n / w) * out.attentions[index][0, :, -w:, :].double().sum(dim=1)  # [Hq, n]
        attention = [alpha if utility == "global" else (alpha + own[h]) / 2 for h in range(query_heads)]
        layer_scores = torch.stack(
            [weights[h] * attention[h] * rho[h // (query_heads // kv_heads)] for h in range(query_heads)]
        ).amax(dim=0)
        layer_scores[-w:] = float("inf")
        scores.append(layer_scores)
        thresholds.append(fixed_threshold or float(t["risk_thresholds"][budget_index, layer, e_bin, p_bin]))
    if elastic:
        counts = [min(budget, int((s >= tau).sum())) for s, tau in zip(scores, thresholds)]
    else:
        ranked = sorted(
            (-float(s[j]) / tau, layer, j) for layer, (s, tau) in enumerate(zip(scores, thresholds)) for j in range(n)
        )
        counts = [0] * len(scores)
        for _, layer, _ in ranked[: budget * len(scores)]:
            counts[layer] += 1
    return [s.topk(count).indices.sort().values for s, count in zip(scores, counts)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"uniform_heads": True},
        {"fixed_threshold": 0.9},
        {"elastic": True},
        {"elastic": True, "fixed_threshold": 0.9},
        {"utility": "head"},
        {"utility": "head", "elastic": True},
    ],
)
@pytest.mark.parametrize("budget_index", [0, 1])
def test_kept_entries_match_the_specs_selection_from_eager_attention(tiny, tmp_path, prompt, budget_index, options):
    expected = reference_kept(tiny, prompt, budget_index, **options)
    options = dict(options)
    utility = options.pop("utility", "global")  # a property of the tables, not a method option
    tables = save_tables(tiny, tmp_path, utility=utility)
    with kvruntime.compress(
        tiny, "compilerkv", budget=BUDGETS[budget_index], artifacts=[tables], options=options
    ) as session:
        session.prefill(prompt)
    for layer, indices in enumerate(expected):
        for kv_head in range(2):  # one index set per layer, shared by its KV heads
            assert session.kept_positions[layer][0, kv_head].tolist() == indices.tolist()
    assert session.report.slots_per_layer == [len(k) for k in expected]
    if options.get("elastic"):
        assert all(len(k) <= BUDGETS[budget_index] for k in expected)
    else:  # ratio-honest: exactly what was asked for, shared by the layers
        assert sum(session.report.slots_per_layer) == 4 * BUDGETS[budget_index]


def _signals_prefill(length: int) -> PrefillResult:
    return PrefillResult(
        length=length,
        num_kv_heads=2,
        input_ids=torch.randint(0, 96, (1, length)),
        hidden_states=torch.randn(1, length, 8),
        output_logits=torch.nn.Linear(8, 96),
        second_pass_attention=list,
        lookahead_attention=list,
    )


def _heavy_hitter_statistics(length: int) -> list[LayerSignals]:
    """Attention mass on a few tokens (as in real models; a random one attends almost uniformly)."""
    mass = torch.full((1, length), 0.1 / length)
    mass[0, [3, 50, 77]] = 0.3  # three heavy hitters outside the 64-token window
    return [(mass, torch.ones(1, 2, length), length * mass[:, None].expand(1, 4, -1)) for _ in range(4)]


def test_the_elastic_gate_may_keep_fewer_entries_than_the_budget_and_says_so(tables):
    """The gate admits the window and the three heavy hitters, fewer than the budget, and the layer keeps just
    them; the report says how much of what was asked for is held."""
    artifacts = [kvruntime.read_artifact(tables)]
    method = kvruntime.get_method("compilerkv", artifacts, {"fixed_threshold": 0.9, "elastic": True})
    with torch.no_grad():  # as the engine calls it
        selection = method.select(
            _heavy_hitter_statistics(200), kvruntime.Request(budget=100).plan(200, 64), _signals_prefill(200)
        )
    assert selection.counts.tolist() == [[67, 67]] * 4  # the window and the three, not the budget of 100
    top = selection.scores[0][0, 0].topk(67).indices
    assert {3, 50, 77} <= set(top.tolist())
    assert "elastic: keeps 268 of the 400 entries asked for (67.0%" in "\n".join(selection.notes)


def test_the_ratio_honest_gate_holds_what_was_asked_and_gives_more_to_layers_with_lower_thresholds():
    """The same scores in every layer (W_head = 1): the window (64) and the three heavy hitters stay everywhere, and
    the rest of the 400 entries asked for goes to the layer whose threshold the light tokens clear by most."""
    with torch.no_grad():
        selection = CompilerKV(tables=_flat_tables([0.9, 0.8, 1.0, 0.85], None)).select(
            _heavy_hitter_statistics(200), kvruntime.Request(budget=100).plan(200, 64), _signals_prefill(200)
        )
    assert selection.counts[:, 0].tolist() == [67, 199, 67, 67]
    assert "the layers share the 400 entries asked for, ranked by score over their layer's threshold: 67-199" in (
        "\n".join(selection.notes)
    )


def _flat_tables(thresholds: list[float], elastic: bool | None) -> CompilerKVTables:
    return CompilerKVTables(
        budgets=(100,),
        head_reliability=torch.ones(1, 4, 4),
        risk_thresholds=torch.tensor(thresholds).view(1, 4, 1, 1).expand(1, 4, 2, 2).clone(),
        entropy_edges=torch.tensor([4.0], dtype=torch.float64),
        perplexity_edges=torch.tensor([90.0], dtype=torch.float64),
        elastic=elastic,
    )


@pytest.mark.parametrize(
    ("learned_elastic", "option", "counts", "mismatch"),
    [
        (True, None, [67, 67, 67, 67], None),  # the tables' own rule: elastic keeps just what clears 0.9
        # ratio-honest: the 400 entries asked for are all held; equal scores tie, and ties go to the earlier layer
        (False, None, [199, 67, 67, 67], None),
        (None, None, [199, 67, 67, 67], None),  # tables that do not record a rule: ratio-honest
        (True, False, [199, 67, 67, 67], "learned under the elastic rule, run under the ratio-honest one"),
        (False, True, [67, 67, 67, 67], "learned under the ratio-honest rule, run under the elastic one"),
    ],
)
def test_the_keep_rule_is_the_tables_own_unless_overridden_and_a_mismatch_is_reported(
    learned_elastic, option, counts, mismatch
):
    method = CompilerKV(tables=_flat_tables([0.9] * 4, learned_elastic), elastic=option)
    with torch.no_grad():
        selection = method.select(
            _heavy_hitter_statistics(200), kvruntime.Request(budget=100).plan(200, 64), _signals_prefill(200)
        )
    assert selection.counts[:, 0].tolist() == counts
    notes = "\n".join(selection.notes)
    assert (mismatch in notes) if mismatch else ("rule   " not in notes)


@pytest.mark.parametrize("threshold", [0.0, -0.5, 1.5])
def test_a_fixed_threshold_outside_the_tables_range_is_refused(threshold):
    with pytest.raises(KVRuntimeError, match=rf"fixed_threshold={threshold}: give a value in \[0.8, 1.0\]"):
        get_method(CompilerKV(tables=_flat_tables([0.9] * 4, None), fixed_threshold=threshold))


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
    assert sum(session.report.slots_per_layer) == 4 * 90  # what was asked for, with the nearest budget's tables
    assert "tables of compiled budget 100" in str(session.report)


def test_a_ratio_runs_the_nearest_compiled_budgets_tables_and_holds_what_the_ratio_asks(tiny, tables, prompt):
    with kvruntime.compress(tiny, "compilerkv", ratio=0.45, artifacts=[tables]) as session:
        session.prefill(prompt)
    assert sum(session.report.slots_per_layer) == 4 * 88  # 55% of the 160 tokens, in each of the 4 layers
    assert "tables of compiled budget 100 (the nearest to the 88 tokens per layer asked for)" in str(session.report)
    kept = []  # a ratio that asks for a compiled budget selects what that budget selects
    for request in ({"ratio": 1 - 100 / 160}, {"budget": 100}):
        with kvruntime.compress(tiny, "compilerkv", artifacts=[tables], **request) as session:
            session.prefill(prompt)
        kept.append(session.kept_positions)
    assert len(kept[0]) == len(kept[1]) == 4
    assert all(torch.equal(ratio, budget) for ratio, budget in zip(*kept))


def test_method_options_are_checked(tiny, tables):
    with pytest.raises(KVRuntimeError, match="unknown compilerkv options"):
        kvruntime.get_method("compilerkv", [kvruntime.read_artifact(tables)], {"budget_nearest": True})
    with pytest.raises(
        KVRuntimeError, match=r"unknown snapkv options \['nearest_budget'\] \(known: \['merge', 'window'\]\)"
    ):
        kvruntime.get_method("snapkv", [], {"nearest_budget": True})
    with pytest.raises(KVRuntimeError, match="unknown method 'compilerkv\\+error-aware'"):
        kvruntime.get_method("compilerkv+error-aware", [])
    with pytest.raises(KVRuntimeError, match="needs a compilerkv_tables artifact"):
        kvruntime.get_method("compilerkv", [])


def test_tables_of_another_layer_count_need_force_and_are_interpolated_over_depth(tiny, tmp_path, prompt):
    deeper = dataclasses.replace(model_fingerprint(tiny), num_layers=7)
    path = save_artifact(
        Artifact("compilerkv_tables", table_tensors(layers=7), deeper, {"command": "test"}), tmp_path / "t.safetensors"
    )
    with pytest.raises(ArtifactError, match="with 7 layers, the model .* with 4; pass force=True"):
        kvruntime.load_artifact(path, model=tiny)
    with pytest.warns(UserWarning, match="applied by relative depth"):
        with kvruntime.compress(tiny, "compilerkv", budget=100, artifacts=[path], force=True) as session:
            session.prefill(prompt)
    assert len(session.report.slots_per_layer) == 4
    other_heads = dataclasses.replace(model_fingerprint(tiny), num_query_heads=8)
    path = save_artifact(
        Artifact("compilerkv_tables", table_tensors(), other_heads, {"command": "test"}), tmp_path / "h.safetensors"
    )
    with pytest.raises(ArtifactError, match="num_query_heads: 8 vs 4"):
        kvruntime.load_artifact(path, model=tiny, force=True)


def test_question_mode_answers_from_exactly_the_entries_compilerkv_kept(tiny, tables, prompt):
    """Every answer step's logits are those of the full model attending only to the kept entries (by position)."""
    question = prompt[:, :7]
    got, reference, report, _ = answer_and_reference(
        tiny, prompt, question, "compilerkv", artifacts=[tables], budget=100
    )
    assert sum(report.slots_per_layer) < 4 * prompt.shape[1]  # something was removed
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
