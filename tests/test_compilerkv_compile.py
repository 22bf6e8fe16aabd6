"""`kvcompile tables` on tiny models: the CQL learner against an exact tabular reference, the rollout plumbing
against plain forwards, the whole compile (relearning, resume) and its refusals."""

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CharTokenizer, tiny_model
from distributed_worker import TABLES
from tabular_cql import tabular_cql
from transformers import DynamicCache
from typer.testing import CliRunner

import kvruntime
from kvcompile.calibration.corpus import Corpus
from kvcompile.calibration.job import CompileJob
from kvcompile.cli import app
from kvcompile.recipes.compilerkv import experience_collection
from kvcompile.recipes.compilerkv import tables as tables_module
from kvcompile.recipes.compilerkv.bandit_experience import (
    GATE_ACTIONS,
    GATE_COLUMNS,
    HEAD_ACTIONS,
    HEAD_COLUMNS,
    Experience,
    Records,
    table_advantage,
)
from kvcompile.recipes.compilerkv.continuation_nll import ContinuationScorer, prefilled_prompt
from kvcompile.recipes.compilerkv.experience_collection import design_actions, greedy_continuation, stratified_choice
from kvcompile.recipes.compilerkv.offline_cql import fit_greedy_table, one_hot
from kvcompile.recipes.compilerkv.settings import DESIGNS, CQLSettings
from kvcompile.recipes.compilerkv.tables import compile_tables, relearn_tables
from kvruntime.artifacts.artifact import load_artifact, read_artifact, save_artifact
from kvruntime.errors import ArtifactError, KVRuntimeError
from kvruntime.methods.compilerkv.tables import CompilerKVTables
from kvruntime.plumbing.attention import per_layer_attention
from kvruntime.plumbing.cache_ops import cache_argument


def _synthetic_bandit(seed: int = 0, per_pair: int = 4):
    """10 states x 29 actions with a known best action per state (reward falls off with the distance to it),
    every pair sampled `per_pair` times; one state that only ever tried actions 3 and 20; and one where action 5
    was tried once and did best (1.0) and action 10 twenty times at 0.95: the mean per action picks 5, CQL's
    conservative penalty on the rarely tried picks 10. Returns the records and CQL's best action per state."""
    rng = np.random.default_rng(seed)
    best = rng.integers(0, 29, 10)
    states, actions = np.meshgrid(np.arange(10), np.arange(29), indexing="ij")
    states = np.repeat(states.ravel(), per_pair)
    actions = np.repeat(actions.ravel(), per_pair)
    rewards = 1.0 - 0.1 * np.abs(actions - best[states]) + 0.02 * rng.standard_normal(len(states))
    seen_two, lucky = np.array([3, 20] * 4), np.array([5] + [10] * 20)
    lucky_rewards = np.where(lucky == 5, 1.0, 0.95) + 0.005 * rng.standard_normal(len(lucky))
    states = np.concatenate([states, np.full(len(seen_two), 10), np.full(len(lucky), 11)])
    actions = np.concatenate([actions, seen_two, lucky])
    rewards = np.concatenate([rewards, 1.0 - 0.1 * np.abs(seen_two - 20), lucky_rewards])
    return states, actions, rewards, np.append(best, [20, 10])


def test_d3rlpys_cql_chooses_what_exact_tabular_cql_chooses_where_the_mean_reward_would_not():
    states, actions, rewards, best = _synthetic_bandit()
    q = tabular_cql(torch.from_numpy(states), torch.from_numpy(actions), torch.from_numpy(rewards), 12, 29, alpha=0.75)
    assert q.argmax(dim=1).tolist() == best.tolist()
    lucky = [(a, rewards[(states == 11) & (actions == a)].mean()) for a in (5, 10)]
    assert max(lucky, key=lambda pair: pair[1])[0] == 5  # the mean per action would choose the once-lucky action
    fit = fit_greedy_table(one_hot(states, 12), actions, rewards, 29, np.eye(12, dtype=np.float32), CQLSettings())
    # Every state as exact CQL chooses, the conservative ones included (only actions 3 and 20 seen; once lucky).
    assert fit.actions.tolist() == q.argmax(dim=1).tolist()
    assert len(fit.learning_curve) == 10 and fit.learning_curve[-1] < fit.learning_curve[0]


def test_learning_refuses_nan_rewards():
    states, actions, rewards, _ = _synthetic_bandit()
    rewards[5] = np.nan
    with pytest.raises(KVRuntimeError, match="1 rewards are NaN"):
        fit_greedy_table(one_hot(states, 12), actions, rewards, 29, np.eye(12, dtype=np.float32), CQLSettings(steps=10))


_TEXT = torch.randint(3, 96, (1, 100), generator=torch.Generator().manual_seed(1))


def _tiny_prompt(kind: str = "qwen2", softcap: float | None = None) -> tuple:
    """A tiny model, a prefilled 80-token prompt with a 20-token continuation, and the continuation's logits from
    plain forwards over a cache holding only kept entries of the growing layers (a sliding layer's whole window:
    the independent reference)."""
    model = tiny_model(kind)
    if softcap is not None:  # Gemma's final logit soft-capping, which the model's head applies
        model.config.final_logit_softcapping = softcap
    context, continuation = _TEXT[:, :80], _TEXT[:, 80:]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(context, **cache_argument(model, cache), use_cache=True).logits
    first = float(-logits[0, -1].log_softmax(-1)[continuation[0, 0]])
    prompt = prefilled_prompt(model, cache, continuation, first)

    def logits_over(kept: list[torch.Tensor]) -> torch.Tensor:
        compressed = DynamicCache(config=model.config)
        cut = dict(zip(prompt.growing, kept))
        for layer, (keys, values) in enumerate(zip(prompt.keys, prompt.values)):
            rows = cut.get(layer, torch.arange(keys.shape[2]))
            compressed.update(keys[:, :, rows], values[:, :, rows], layer)
        with per_layer_attention(model), torch.no_grad():
            out = model(
                continuation[:, :-1], **cache_argument(model, compressed), position_ids=torch.arange(80, 99)[None]
            )
        return out.logits[0]

    return model, prompt, logits_over


@pytest.mark.parametrize("kind, softcap", [("qwen2", None), ("gemma3_text", 2.0), ("olmo3", None), ("phi3", None)])
def test_the_prefilled_prompts_full_nll_is_the_plain_models_on_the_whole_text(kind, softcap):
    """The recorded run of the continuation over the prompt's cache, and a rollout keeping everything, give the
    continuation's NLL that one plain forward of the whole text (transformers' own attention, no cache) gives."""
    model, prompt, _ = _tiny_prompt(kind, softcap)
    with torch.no_grad():
        logits = model(_TEXT).logits[0].float()
    plain = float(F.cross_entropy(logits[79:99], _TEXT[0, 80:], reduction="mean"))
    assert prompt.full_nll == pytest.approx(plain, abs=1e-5)
    everything = [torch.arange(80)] * len(prompt.growing)
    assert ContinuationScorer(model, prompt).base(everything).loss == pytest.approx(plain, abs=1e-5)


@pytest.mark.parametrize("kind, softcap", [("qwen2", None), ("gemma3_text", 2.0), ("olmo3", None)])
def test_continuation_scorer_matches_plain_forwards_over_the_same_kept_entries(kind, softcap):
    model, prompt, logits_over = _tiny_prompt(kind, softcap)
    continuation, first = prompt.continuation, prompt.first_nll
    layers = len(prompt.growing)

    def reference(kept: list[torch.Tensor]) -> float:
        return (first + float(F.cross_entropy(logits_over(kept), continuation[0, 1:], reduction="sum"))) / 20

    g = torch.Generator().manual_seed(2)
    kept = [torch.randperm(80, generator=g)[:40].sort().values for _ in range(layers)]
    scorer = ContinuationScorer(model, prompt, batch_size=2)
    base = scorer.base(kept)
    assert base.loss == pytest.approx(reference(kept), abs=1e-6)

    # Variants that change one layer, or several (the ratio-honest gate moves entries between layers), of other
    # sizes (padded within a batch), batched from the first layer each changes.
    def other(n: int) -> torch.Tensor:
        return torch.randperm(80, generator=g)[:n].sort().values

    last = layers - 1
    variants = [
        kept[:last] + [other(30)],
        kept[:last] + [other(55)],
        [other(41)] + kept[1:last] + [other(39)],
        [other(40)] + kept[1:],
        [other(20) for _ in kept],
    ]
    got = scorer.variants(base, variants)
    assert got == pytest.approx([reference(v) for v in variants], abs=1e-6)
    with pytest.raises(ValueError, match="keeps what the base keeps"):
        scorer.variants(base, [list(kept)])


def test_the_kl_loss_is_the_divergence_from_the_full_caches_predictions():
    """loss="kl": per continuation token, KL(full cache || kept entries) of the next-token distributions, from the
    same plain forwards (the first token's is 0: the prefill predicts it)."""
    model, prompt, logits_over = _tiny_prompt()
    full = logits_over([torch.arange(80)] * 4).log_softmax(-1)

    def reference(kept: list[torch.Tensor]) -> float:
        compressed = logits_over(kept).log_softmax(-1)
        return float((full.exp() * (full - compressed)).sum()) / 20

    g = torch.Generator().manual_seed(3)
    kept = [torch.randperm(80, generator=g)[:40].sort().values for _ in range(4)]
    scorer = ContinuationScorer(model, prompt, batch_size=2, loss="kl")
    base = scorer.base(kept)
    assert base.loss == pytest.approx(reference(kept), abs=1e-6) and base.loss > 0
    variants = [kept[:1] + [torch.arange(80)] + kept[2:], [torch.arange(80)] * 3 + [kept[3][:25]]]
    assert scorer.variants(base, variants) == pytest.approx([reference(v) for v in variants], abs=1e-6)
    assert scorer.base([torch.arange(80)] * 4).loss == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="loss 'mse' is none of nll, kl"):
        ContinuationScorer(model, prompt, loss="mse")


def _experience(elastic: bool) -> Experience:
    gate = Records(
        GATE_COLUMNS,
        {
            "prompt": torch.tensor([0, 1]),
            "budget": torch.tensor([0, 0]),
            "layer": torch.tensor([0, 0]),
            "entropy_bin": torch.tensor([0, 0]),
            "perplexity_bin": torch.tensor([0, 0]),
            "action": torch.tensor([3, 3]),
            "nll": torch.tensor([2.50, 4.00], dtype=torch.float64),
            "base_nll": torch.tensor([2.52, 3.99], dtype=torch.float64),
            "candidates": torch.tensor([100, 300]),
            "round": torch.tensor([0, 0]),
        },
    )
    return Experience(
        head=Records(HEAD_COLUMNS),
        gate=gate,
        full_nll=torch.tensor([2.4, 3.9], dtype=torch.float64),  # prompt 1 is the harder one: it cancels
        entropy=torch.zeros(2, dtype=torch.float64),
        perplexity=torch.zeros(2, dtype=torch.float64),
        candidate_risks=torch.zeros(2, 2, dtype=torch.float64),
        chosen=torch.tensor([0, 1]),
        budgets=(200,),
        context_tokens=1000,
        penalty=1.0,
        elastic=elastic,
    )


def test_rewards_are_paired_with_the_base_rollout_and_only_the_elastic_gate_pays_for_excess_candidates():
    honest = _experience(elastic=False).gate_rewards()
    torch.testing.assert_close(honest, torch.tensor([0.02, -0.01], dtype=torch.float64))
    elastic = _experience(elastic=True).gate_rewards()  # 100 over the budget of 200, over 1000 tokens
    torch.testing.assert_close(elastic, torch.tensor([0.02, -0.01 - 0.1], dtype=torch.float64))


def test_experience_from_before_the_keep_rule_was_recorded_is_refused_in_one_line(compiled, tmp_path):
    """As the experience shipped before it was: no `elastic` parameter and none of the candidates' tensors. The
    command says why (not which tensor is missing) and writes nothing."""
    _, _, _, experience = compiled
    params = {k: v for k, v in experience.params.items() if k != "elastic"}
    tensors = {k: v for k, v in experience.tensors.items() if k not in ("candidate_risks", "prompt_candidate")}
    path = save_artifact(
        dataclasses.replace(experience, params=params, tensors=tensors), tmp_path / "compilerkv_experience.safetensors"
    )
    out = tmp_path / "compilerkv_tables.safetensors"
    result = CliRunner().invoke(app, ["tables", "--from-experience", str(path), "--out", str(out)])
    assert result.exit_code == 2
    assert "experience from an older kvcompile" in result.output and "collect it again" in result.output
    assert "missing" not in result.output and not out.exists()
    with pytest.raises(KVRuntimeError, match="experience from an older kvcompile .* collect it again"):
        relearn_tables(read_artifact(path))


def test_table_advantage_rewards_tables_that_chose_what_the_records_favour():
    records = Records(
        ("state", "action"),
        {"state": torch.tensor([0, 0, 0, 0, 1, 1]), "action": torch.tensor([0, 0, 1, 1, 2, 3])},
    )
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    grid = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert table_advantage(torch.tensor([0.0, 3.0]), records, rewards, ("state",), grid) == (0.5, 2)
    # State 1's action 1 was never tried there: only state 0 is judged.
    assert table_advantage(torch.tensor([1.0, 1.0]), records, rewards, ("state",), grid) == (-0.5, 1)


def test_stratified_choice_spreads_the_prompts_over_the_risk_cells():
    """Entropy and perplexity go together in most candidates: the two off-diagonal cells hold one candidate each,
    and the choice still takes them before a second candidate of a common cell."""
    entropy = [1.0, 1.1, 1.2, 5.0, 5.1, 5.2, 1.3, 5.3]
    perplexity = [10.0, 11.0, 12.0, 50.0, 51.0, 52.0, 53.0, 13.0]
    risks = torch.tensor([entropy, perplexity], dtype=torch.float64).T
    cell = {i: (entropy[i] > 3, perplexity[i] > 30) for i in range(8)}
    chosen = stratified_choice(risks, 4, (2, 2), seed=0)
    assert len(set(chosen)) == 4 and {cell[i] for i in chosen} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    six = stratified_choice(risks, 6, (2, 2), seed=0)
    assert six[:4] == chosen and {cell[i] for i in six[4:]} == {(0, 0), (1, 1)}
    assert stratified_choice(risks, 6, (2, 2), seed=0) == six  # seeded
    assert sorted(stratified_choice(risks, 8, (2, 2), seed=1)) == list(range(8))


CORPUS = Corpus("synthetic", tuple("".join(chr(97 + (i * 7 + j * j * 13) % 26) for j in range(9000)) for i in range(2)))
SMALL = dataclasses.replace(TABLES, cql=CQLSettings(steps=60))  # the distributed tests' tables, fitted longer


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    model = tiny_model("llama")
    out = tmp_path_factory.mktemp("tables") / "compilerkv_tables.safetensors"
    tables, experience = compile_tables(CompileJob(model, CharTokenizer(), out), CORPUS, SMALL)
    return model, out, tables, experience


def test_compiled_tables_have_the_issue_shapes_ranges_and_learning_records(compiled):
    model, _, tables, experience = compiled
    t = tables.tensors
    assert t["head_reliability"].shape == (2, 4, 4) and t["risk_thresholds"].shape == (2, 4, 3, 2)
    assert set(t["head_reliability"].unique().tolist()) <= set(HEAD_ACTIONS.tolist())
    assert set(t["risk_thresholds"].unique().tolist()) <= set(GATE_ACTIONS.tolist())
    assert t["entropy_edges"].shape == (2,) and t["perplexity_edges"].shape == (1,)
    assert t["head_learning_curve"].shape == (tables.params["rounds_run"], 10)
    assert t["round_changes"].shape == (tables.params["rounds_run"], 2)
    assert (
        int(t["head_support"].sum()) == tables.params["head_records"] == len(Experience.from_artifact(experience).head)
    )
    # States without records fall back: W_head 1.0; a (budget, layer) without gate records: 0.8.
    assert bool((t["head_reliability"][t["head_support"] == 0] == 1.0).all())
    CompilerKVTables.from_artifact(tables)  # valid for the runtime


def test_relearning_from_the_stored_experience_reproduces_the_tables(compiled, tmp_path):
    _, _, tables, experience = compiled
    path = save_artifact(experience, tmp_path / "compilerkv_experience.safetensors")
    relearned = relearn_tables(read_artifact(path))
    for name in ("head_reliability", "risk_thresholds", "entropy_edges", "perplexity_edges"):
        assert torch.equal(relearned.tensors[name], tables.tensors[name]), name


def test_compiled_tables_run_in_the_runtime(compiled, tmp_path):
    model, _, tables, _ = compiled
    path = save_artifact(tables, tmp_path / "compilerkv_tables.safetensors")
    ids = torch.randint(3, 96, (1, 150), generator=torch.Generator().manual_seed(4))
    with kvruntime.compress(model, "compilerkv", budget=120, artifacts=[path]) as session:
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert sum(session.report.slots_per_layer) == 4 * 120  # ratio-honest: the layers share what was asked for


def test_an_interrupted_compile_resumes_to_the_same_tables(compiled, tmp_path, monkeypatch):
    model, _, tables, _ = compiled
    out = tmp_path / "compilerkv_tables.safetensors"
    real = tables_module.collect_unit
    calls = {"n": 0}

    def crash_in_round_two(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 15:  # 6 units per phase: the third unit of round 2's head phase
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tables_module, "collect_unit", crash_in_round_two)
    with pytest.raises(KeyboardInterrupt):
        compile_tables(CompileJob(model, CharTokenizer(), out), CORPUS, SMALL)
    monkeypatch.setattr(tables_module, "collect_unit", real)
    resumed, _ = compile_tables(CompileJob(model, CharTokenizer(), out, resume=True), CORPUS, SMALL)
    for name in ("head_reliability", "risk_thresholds", "head_support", "gate_support", "round_changes"):
        assert torch.equal(resumed.tensors[name], tables.tensors[name]), name


def test_experience_of_another_model_is_refused(compiled, tmp_path):
    _, _, _, experience = compiled
    path = save_artifact(experience, tmp_path / "compilerkv_experience.safetensors")
    with pytest.raises(ArtifactError, match="another checkpoint"):
        load_artifact(path, model=tiny_model("llama", seed=1), kind="compilerkv_experience")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(budgets=(40, 120)), "between the 64-token window and the 160-token context"),
        (dict(budgets=(120, 80)), "distinct budgets in increasing order"),
        (dict(prompts=1), "--prompts must be at least 2"),
    ],
)
def test_bad_settings_are_refused_before_any_model_work(change, message):
    import dataclasses

    with pytest.raises(KVRuntimeError, match=message):
        compile_tables(
            CompileJob(tiny_model("llama"), CharTokenizer(), Path("/nonexistent/x")),
            CORPUS,
            dataclasses.replace(SMALL, **change),
        )


def test_a_corpus_too_short_for_the_prompts_is_refused():
    short = Corpus("short", ("a few words only",))
    with pytest.raises(KVRuntimeError, match="too short for 172-token prompts"):
        compile_tables(CompileJob(tiny_model("llama"), CharTokenizer(), Path("/nonexistent/x")), short, SMALL)


def test_a_model_with_non_finite_outputs_is_refused_and_nothing_is_written(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    out = tmp_path / "compilerkv_tables.safetensors"
    with pytest.raises(KVRuntimeError, match="continuation NLL is nan"):
        compile_tables(CompileJob(model, CharTokenizer(), out), CORPUS, SMALL)
    assert not out.exists()


EVERY_STATE = dataclasses.replace(
    SMALL,
    budgets=(100,),
    rounds=1,
    entropy_bins=1,
    perplexity_bins=1,
    loss="kl",
    continuation_from="greedy",
    design=DESIGNS["every-state"],
)


def test_the_every_state_design_probes_every_state_on_every_prompt_with_its_own_actions(monkeypatch, tmp_path):
    """Every (layer, query head) gets weights 1.0 and 1.5, every layer thresholds 0.8, 0.9 and 1.0, on every prompt;
    the actions the neutral tables already take cost no rollout and have reward 0; the KL loss reaches the scorer."""
    losses = []
    real_scorer = experience_collection.ContinuationScorer

    def spy(*args, loss="nll", **kwargs):
        losses.append(loss)
        return real_scorer(*args, loss=loss, **kwargs)

    monkeypatch.setattr(experience_collection, "ContinuationScorer", spy)
    model = tiny_model("llama")
    out = tmp_path / "compilerkv_tables.safetensors"
    tables, artifact = compile_tables(CompileJob(model, CharTokenizer(), out), CORPUS, EVERY_STATE)
    prompts, layers, heads = EVERY_STATE.prompts, 4, 4
    # One scorer per unit (head and gate phases) on the KL (the full cache's NLL is the model's own forward's).
    assert losses == ["kl"] * (2 * prompts)
    experience = Experience.from_artifact(artifact)
    head, gate = experience.head, experience.gate
    head_actions = HEAD_ACTIONS[head.column("action")]
    gate_actions = GATE_ACTIONS[gate.column("action")]
    assert len(head) == prompts * layers * heads * 2 and len(gate) == prompts * layers * 3
    assert set(head_actions.tolist()) == {1.0, 1.5}
    assert torch.allclose(torch.tensor(sorted(set(gate_actions.tolist()))), torch.tensor([0.8, 0.9, 1.0]))
    states = head.column("prompt") * layers * heads + head.column("layer") * heads + head.column("head")
    assert torch.equal(torch.bincount(states), torch.full((prompts * layers * heads,), 2))
    neutral_head = head_actions == 1.0
    assert bool((experience.head_rewards()[neutral_head] == 0).all())
    neutral_gate = (gate_actions - 0.9).abs() < 1e-6
    assert bool((experience.gate_rewards()[neutral_gate] == 0).all())
    assert bool((head.column("base_nll") > 0).all())  # a KL from the full cache: positive when entries are dropped
    assert tables.tensors["risk_thresholds"].shape == (1, layers, 1, 1)


def test_the_greedy_continuation_is_the_full_cache_models_own_argmax_tokens():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    text = greedy_continuation(model, ids, context_tokens=30, tokens=6)
    reference = ids[:, :30]
    with torch.no_grad():
        for _ in range(6):  # no cache: every step recomputes the whole prefix
            reference = torch.cat([reference, model(reference).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(text, reference)


def test_design_actions_off_the_grid_are_refused():
    design = dataclasses.replace(DESIGNS["every-state"], head_weights=(1.0, 1.23))
    with pytest.raises(KVRuntimeError, match=r"head actions \[1.23\] are not on the action grid"):
        design_actions("head", design, random.Random(0))
