"""The distilled scorer: the ridge fit from sufficient statistics against a direct reference, the compile recipe on
a tiny model (shards and resumption give the artifact of one run), and the runtime method it feeds."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CharTokenizer, scorer_that_prefers, tiny_model
from distributed_worker import CORPUS, DISTILL
from test_engine import answer_and_reference
from typer.testing import CliRunner

import kvruntime
from kvcompile import recipe
from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.calibration.distributed import Shard
from kvcompile.calibration.job import CompileJob
from kvcompile.calibration.partial_statistics import merge_partials
from kvcompile.calibration.shards import PARTIAL_KIND
from kvcompile.cli import app
from kvcompile.recipes.distilled import distill
from kvcompile.recipes.distilled.distill import (
    compile_distilled_scorer,
    finish_distilled_scorer,
    held_out_error,
    ridge,
)
from kvcompile.recipes.distilled.settings import HELD_OUT_EVERY, DistillSettings
from kvruntime import Artifact, KVRuntimeError, model_fingerprint, save_artifact
from kvruntime.math.allocation import apportion, error_aware_budgets, refloored_shares
from kvruntime.math.attention_logits import AttentionLogits
from kvruntime.math.repetition import later_occurrences, repeated_ngram_fraction, repeats
from kvruntime.methods import Distilled, get_method
from kvruntime.methods.base import LayerInputs
from kvruntime.methods.distilled import (
    DistilledScorer,
    feature_count,
    key_leverage,
    likeness_to_earlier,
    predicted_scores,
    predicted_token_scores,
    token_features,
    with_leverage,
)
from kvruntime.methods.distilled.features import LIKENESS_BLOCK
from kvruntime.methods.distilled.spec import SPEC
from kvruntime.requests.request import Request, kept_per_head

runner = CliRunner()


def test_ridge_and_its_held_out_error_from_sums_match_a_direct_computation():
    rng = np.random.default_rng(0)
    x_fit, x_out = rng.normal(size=(200, 6)), rng.normal(size=(50, 6))
    w_true = rng.normal(size=(6, 2))
    y_fit, y_out = x_fit @ w_true + 0.1 * rng.normal(size=(200, 2)), x_out @ w_true + 0.1 * rng.normal(size=(50, 2))
    alpha = 0.01
    lam = alpha * np.mean(np.diag(x_fit.T @ x_fit))
    expected = np.linalg.solve(x_fit.T @ x_fit + lam * np.eye(6), x_fit.T @ y_fit)
    t = lambda a: torch.tensor(a)  # noqa: E731
    w = ridge(t(x_fit.T @ x_fit), t(x_fit.T @ y_fit), alpha)
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-10)
    error = held_out_error(w, t(x_out.T @ x_out), t(x_out.T @ y_out), t((y_out**2).sum(axis=0)))
    np.testing.assert_allclose(error.numpy(), ((y_out - x_out @ expected) ** 2).sum(axis=0), rtol=1e-8)


def test_the_finished_scorer_recovers_an_exact_linear_map_and_picks_the_weakest_ridge():
    rng = np.random.default_rng(1)
    layers, features, heads = 2, 5, 3
    w_true = torch.tensor(rng.normal(size=(layers, features, heads)))
    shares = torch.tensor(rng.dirichlet(np.ones(layers), size=(8, len(distill.SHARE_RATIOS))))  # 8 prompts'
    sums = {"tokens_held_out": torch.tensor([100.0]), "layer_shares_all": shares.sum(dim=0)}
    for part, count in (("fit", 300), ("held_out", 100)):
        x = torch.tensor(rng.normal(size=(layers, count, features)))
        y = x @ w_true
        sums[f"xtx_{part}"], sums[f"xty_{part}"] = x.transpose(1, 2) @ x, x.transpose(1, 2) @ y
        if part == "held_out":
            sums["yty_held_out"], sums["ysum_held_out"] = (y * y).sum(dim=1), y.sum(dim=1)
    run = distill.StatisticsRun(
        "distilled_scorer", model_fingerprint(tiny_model("llama")), {"oracle": "x", "prompt_tokens": 1}, 8, {}
    )
    artifact = finish_distilled_scorer(sums, run)
    torch.testing.assert_close(
        artifact.tensors["alpha"], torch.full((layers,), distill.ALPHAS[0])
    )  # no noise: the weakest ridge
    torch.testing.assert_close(artifact.tensors["weights"].double(), w_true, atol=1e-3, rtol=1e-3)
    assert bool((artifact.tensors["held_out_r2"][:, 0] > 0.999).all())
    # The compiled allocation: the prompts' layer shares averaged, per ratio of the grid.
    torch.testing.assert_close(artifact.tensors["layer_shares"].double(), shares.mean(dim=0), atol=1e-6, rtol=0)
    assert artifact.tensors["share_ratios"].tolist() == pytest.approx(list(distill.SHARE_RATIOS))


def test_kvzaps_student_is_the_least_squares_fit_on_the_hidden_state_and_bias_alone():
    """`--student hidden`: the fit reads features 0..hidden (the attention input and the bias) and nothing else; it
    equals a direct least-squares fit on those columns (the weakest ridge, near zero), the others weigh 0."""
    rng = np.random.default_rng(2)
    layers, features, heads, hidden = 2, 7, 2, 3  # 3 hidden features + 4 extras
    w_true = torch.tensor(rng.normal(size=(layers, features, heads)))
    sums, xs, ys = {"tokens_held_out": torch.tensor([100.0]), "layer_shares_all": torch.full((19, layers), 4.0)}, [], []
    for part, count in (("fit", 300), ("held_out", 100)):
        x = torch.tensor(rng.normal(size=(layers, count, features)))
        y = x @ w_true  # the extras matter: a fit that read them would differ
        xs.append(x), ys.append(y)
        sums[f"xtx_{part}"], sums[f"xty_{part}"] = x.transpose(1, 2) @ x, x.transpose(1, 2) @ y
        if part == "held_out":
            sums["yty_held_out"], sums["ysum_held_out"] = (y * y).sum(dim=1), y.sum(dim=1)
    run = distill.StatisticsRun(
        "distilled_scorer",
        model_fingerprint(tiny_model("llama")),
        {"oracle": "kvzip_plus", "prompt_tokens": 1, "student": "hidden"},
        8,
        {},
    )
    weights = finish_distilled_scorer(sums, run).tensors["weights"].double()
    x, y = torch.cat(xs, dim=1), torch.cat(ys, dim=1)
    for layer in range(layers):
        direct = torch.linalg.lstsq(x[layer, :, : hidden + 1], y[layer]).solution
        torch.testing.assert_close(weights[layer, : hidden + 1], direct, atol=1e-3, rtol=1e-3)
    assert bool((weights[:, hidden + 1 :] == 0).all())


def test_token_features_are_the_input_its_position_the_first_token_and_its_likeness_to_earlier_tokens():
    hidden = torch.randn(1, 5, 4)
    features = token_features(hidden)
    assert features.shape == (1, 5, feature_count(4)) == (1, 5, 8) and features.dtype == torch.float32
    torch.testing.assert_close(features[0, :, :4], hidden[0])
    assert features[0, :, 4].tolist() == [1.0] * 5
    torch.testing.assert_close(features[0, :, 5], torch.arange(5, dtype=torch.float32).log1p())
    assert features[0, :, 6].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(features[0, :, 7], likeness_to_earlier(hidden)[0])


def test_the_runtime_scores_a_chunk_as_the_compiled_features_times_the_weights_would():
    hidden, weights = torch.randn(2, 9, 6), torch.randn(feature_count(6), 3)
    for start, carry in ((0, None), (40, torch.randn(2, 6))):
        expected = predicted_scores(token_features(hidden, start, carry), weights)
        torch.testing.assert_close(predicted_token_scores(hidden, weights, start, carry), expected)


@pytest.mark.parametrize("length", [7, 2 * LIKENESS_BLOCK, 2 * LIKENESS_BLOCK + 11])  # a tail alone; blocks alone; both
def test_likeness_to_earlier_is_the_cosine_to_the_mean_of_the_earlier_tokens_but_the_first(length):
    # States with a shared direction, as a model's are: the cosines spread over (0, 1), not around 0.
    hidden = torch.randn(2, length, 5, dtype=torch.float64) + torch.randn(5, dtype=torch.float64)
    expected = torch.zeros(2, length)
    for b in range(2):
        for i in range(2, length):
            mean = hidden[b, 1:i].mean(dim=0)
            expected[b, i] = float(hidden[b, i] @ mean / (hidden[b, i].norm() * mean.norm()))
    torch.testing.assert_close(likeness_to_earlier(hidden), expected)
    split = length // 2 + 3  # a streamed prompt's second chunk, with the sum of the first but its first token
    carry = hidden[:, 1:split].float().sum(dim=1)
    torch.testing.assert_close(likeness_to_earlier(hidden[:, split:], split, carry), expected[:, split:])
    repeated = torch.cat([torch.randn(1, 1, 5), torch.randn(1, 1, 5).expand(1, 6, 5)], dim=1)
    assert bool((likeness_to_earlier(repeated)[0, 2:] > 0.9999).all())  # a state said again is like its copies
    changed = hidden.clone()
    changed[:, 4:] = torch.randn(2, length - 4, 5, dtype=torch.float64)
    # causal: what comes later never changes a token's value
    torch.testing.assert_close(likeness_to_earlier(changed)[:, :4], likeness_to_earlier(hidden)[:, :4])


def test_distilled_with_budgets_keeps_its_best_tokens_under_the_error_aware_layer_budgets(tiny, tokens, tmp_path):
    hidden, fingerprint = tiny.config.hidden_size, model_fingerprint(tiny)
    layer_error = torch.tensor([0.1, 0.5, 0.3, 0.1])
    budgets = Artifact("layer_budgets", {"layer_error": layer_error}, fingerprint, {}, {})
    paths = [
        save_artifact(scorer_that_prefers(tiny, hidden + 1, sign=-1.0), tmp_path / "oldest.safetensors"),
        save_artifact(budgets, tmp_path / "layer_budgets.safetensors"),
    ]
    scorer = DistilledScorer.from_artifact(kvruntime.read_artifact(paths[0]))
    method = Distilled(scorer=scorer, window=8, leverage=0.0).with_layer_budgets(layer_error)  # the scorer's order
    with kvruntime.compress(tiny, method, budget=24) as session:
        session.prefill(tokens)
    length, window = tokens.shape[1], 8
    expected = error_aware_budgets(layer_error.tolist(), 24, length=length)
    assert session.report.method == "distilled+error-aware" and session.report.slots_per_layer == expected
    for positions, slots in zip(session.kept_positions, expected):
        assert all(
            p.tolist() == sorted({*range(slots - window), *range(length - window, length)}) for p in positions[0]
        )
    with kvruntime.compress(tiny, "distilled+error-aware", budget=24, artifacts=paths, options={"window": 8}) as named:
        named.prefill(tokens)
    assert named.report.method == "distilled+error-aware" and named.report.slots_per_layer == expected
    for options in ({"allocation": "uniform"}, {"floor": 0.1}):  # refused, never silently ignored
        with pytest.raises(KVRuntimeError, match=r"from the layer_budgets artifact: options \['(allocation|floor)'\]"):
            with kvruntime.compress(tiny, "distilled+error-aware", budget=24, artifacts=paths, options=options) as s:
                s.prefill(tokens)


def test_a_scorer_of_another_feature_layout_is_refused_in_one_line(tiny, tokens, tmp_path):
    fingerprint = model_fingerprint(tiny)
    weights = torch.zeros(fingerprint.num_layers, tiny.config.hidden_size + 3, fingerprint.num_kv_heads)
    old = Artifact("distilled_scorer", {"weights": weights}, fingerprint, {}, {"oracle": "test"})
    path = save_artifact(old, tmp_path / "old.safetensors")
    options = {"window": 8, "allocation": "dynamic"}  # the default would first miss the compiled layer shares
    with pytest.raises(KVRuntimeError, match="reads 67 features per token, this runtime makes 68: recompile"):
        with kvruntime.compress(tiny, "distilled", ratio=0.5, artifacts=[path], options=options) as session:
            session.prefill(tokens)


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    out = tmp_path_factory.mktemp("distilled") / "distilled_scorer.safetensors"
    artifact = compile_distilled_scorer(CompileJob(tiny_model("llama"), CharTokenizer(), out), CORPUS, DISTILL)
    return save_artifact(artifact, out)


def test_the_recipe_writes_a_scorer_per_layer_and_kv_head_that_shards_and_resumption_reproduce(
    scorer, tmp_path, monkeypatch
):
    whole = kvruntime.read_artifact(scorer)
    assert whole.kind == "distilled_scorer" and whole.tensors["weights"].shape == (4, feature_count(64), 2)
    assert DISTILL.prompts // HELD_OUT_EVERY == 1 and whole.tensors["held_out_r2"].shape == (4, len(distill.ALPHAS))
    model = tiny_model("llama")
    parts = [
        compile_distilled_scorer(CompileJob(model, CharTokenizer(), tmp_path / "p", shard=Shard(i, 2)), CORPUS, DISTILL)
        for i in range(2)
    ]
    assert all(part.kind == PARTIAL_KIND for part in parts)
    merged = merge_partials(parts, {"distilled_scorer": finish_distilled_scorer})
    assert torch.equal(merged.tensors["weights"], whole.tensors["weights"])
    real, calls = distill.prompt_features_and_targets, []

    def fail_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    out = tmp_path / "resumed.safetensors"
    monkeypatch.setattr(distill, "prompt_features_and_targets", fail_third)
    with pytest.raises(KeyboardInterrupt):
        compile_distilled_scorer(CompileJob(model, CharTokenizer(), out, checkpoint_every=1), CORPUS, DISTILL)
    monkeypatch.setattr(distill, "prompt_features_and_targets", real)
    resumed = compile_distilled_scorer(CompileJob(model, CharTokenizer(), out, resume=True), CORPUS, DISTILL)
    assert torch.equal(resumed.tensors["weights"], whole.tensors["weights"])


@pytest.mark.parametrize("allocation", ["dynamic", "uniform"])
def test_each_head_keeps_its_own_best_tokens_in_shared_slots_and_the_ratio_holds(tiny, tokens, tmp_path, allocation):
    hidden = tiny.config.hidden_size
    path = save_artifact(scorer_that_prefers(tiny, hidden + 1, sign=-1.0), tmp_path / "oldest.safetensors")
    options = {"allocation": allocation, "window": 8, "leverage": 0.0}
    with kvruntime.compress(tiny, "distilled", ratio=0.5, artifacts=[path], options=options) as s:
        s.prefill(tokens)
    length, window = tokens.shape[1], 8
    report = s.report
    assert report.bytes_after == pytest.approx(report.bytes_before / 2, rel=0.01)
    for positions, slots in zip(s.kept_positions, report.slots_per_layer):
        # score -log1p(position): the oldest tokens first, then the protected window
        expected = sorted({*range(slots - window), *range(length - window, length)})
        assert all(p.tolist() == expected for p in positions[0])
    if allocation == "uniform":
        assert len(set(report.slots_per_layer)) == 1


def test_the_floor_lifts_every_layer_to_its_share_of_the_average(tiny, tokens, tmp_path):
    scorer = scorer_that_prefers(tiny, tiny.config.hidden_size + 1, sign=-1.0)
    scorer.tensors["weights"][1, tiny.config.hidden_size] = 5.0  # a bias: layer 1's tokens outscore the others'
    path = save_artifact(scorer, tmp_path / "s.safetensors")
    slots = {}
    for floor in (0.0, 0.5):
        options = {"allocation": "dynamic", "floor": floor, "window": 8, "leverage": 0.0}
        with kvruntime.compress(tiny, "distilled", ratio=0.75, artifacts=[path], options=options) as s:
            s.prefill(tokens)
        slots[floor] = s.report.slots_per_layer
    keep = kept_per_head(tokens.shape[1], 8, ratio=0.75)
    assert sum(slots[0.5]) == sum(slots[0.0]) == keep * len(slots[0.0])
    assert min(slots[0.5]) >= keep // 2 > min(slots[0.0])
    with pytest.raises(kvruntime.KVRuntimeError, match="floor"):
        get_method(Distilled(scorer=DistilledScorer(torch.zeros(1, 1, 1), "test"), floor=1.5))


def scorer_with_floored_shares(model: torch.nn.Module, tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A scorer whose compiled shares are the teacher's floor 0.25 plus a pool growing with the layer, and that pool."""
    layers = model.config.num_hidden_layers
    pool = torch.arange(1.0, layers + 1, dtype=torch.float64) ** 2
    pool /= pool.sum()
    artifact = scorer_that_prefers(model, model.config.hidden_size + 1, sign=-1.0)
    artifact.tensors["layer_shares"] = (0.25 / layers + 0.75 * pool).expand(4, -1).clone()
    return save_artifact(artifact, tmp_path / "s.safetensors"), pool


def test_a_floor_given_to_the_compiled_allocation_refloors_the_teachers_shares(tiny, tokens, tmp_path):
    """The teacher's allocation gave every layer the compiled floor first and pooled the rest: with another floor,
    each layer gets the new floor plus its pooled part scaled to what that floor leaves."""
    layers = tiny.config.num_hidden_layers
    path, pool = scorer_with_floored_shares(tiny, tmp_path)
    length, window = tokens.shape[1], 8
    keep = kept_per_head(length, window, ratio=0.5)
    for floor in (0.25, 0.6, 1.0):
        expected = apportion(floor / layers + (1 - floor) * pool, keep * layers, low=window, high=length).tolist()
        options = {"floor": floor, "window": window}
        with kvruntime.compress(tiny, "distilled", ratio=0.5, artifacts=[path], options=options) as s:
            s.prefill(tokens)
        assert s.report.slots_per_layer == expected
    assert len(set(expected)) <= 2  # floor 1: the same count in every layer
    torch.testing.assert_close(
        refloored_shares(torch.tensor([0.1, 0.9]), 0.5, 0.0), torch.tensor([0.0, 1.0], dtype=torch.float64)
    )


def test_a_prompt_that_repeats_gets_the_repeating_floor_when_one_is_given(tiny, tokens, tmp_path):
    """The compiled shares are re-floored with `repeating_floor` for a prompt a quarter or more of whose 8-grams came
    earlier in it, in one piece or streamed, and with `floor` otherwise."""
    layers = tiny.config.num_hidden_layers
    path, pool = scorer_with_floored_shares(tiny, tmp_path)
    repeating = tokens[:, :20].repeat(1, 4)  # 80 tokens, 53 of its 73 8-grams seen before
    window = 8
    keep = kept_per_head(tokens.shape[1], window, ratio=0.5)

    def slots(prompt: torch.Tensor, chunk: int | None = None) -> tuple[list[int], str]:
        options = {"repeating_floor": 1.0, "window": window}
        with kvruntime.compress(
            tiny, "distilled", ratio=0.5, artifacts=[path], options=options, prefill_chunk_size=chunk
        ) as s:
            s.prefill(prompt)
        return s.report.slots_per_layer, s.report.notes[-1]

    def expected(floor: float) -> list[int]:
        return apportion(floor / layers + (1 - floor) * pool, keep * layers, low=window, high=80).tolist()

    for chunk in (None, 32):
        counts, note = slots(repeating, chunk)
        assert counts == expected(1.0) and "the prompt repeats: 0.73 of its 8-grams" in note
        counts, note = slots(tokens, chunk)
        assert counts == expected(0.25) != expected(1.0) and "repeats" not in note


def test_later_occurrences_count_the_copies_of_each_8gram_still_to_come():
    ids = torch.randint(0, 3, (200,), generator=torch.Generator().manual_seed(0))  # 3 symbols: 8-grams recur
    grams = [tuple(ids[i - 7 : i + 1].tolist()) for i in range(7, 200)]
    expected = [0] * 7 + [grams[k + 1 :].count(grams[k]) for k in range(len(grams))]
    assert later_occurrences(ids).tolist() == expected
    assert later_occurrences(ids[:5]).tolist() == [0] * 5


def test_the_shipped_defaults_are_the_values_their_measurements_chose():
    """Each option of distilled's registration, its window and the repetition measure at the value a measurement
    chose (docs/methods/distilled.md names the run behind each): changing one is a decision that comes with its own
    run, and with this line. The reference replays in test_selection_references.py pin what they do."""
    from kvruntime.math.repetition import NGRAM, REPEATING_FRACTION, repeats
    from kvruntime.methods.distilled.spec import SPEC

    defaults = {name: option.default for name, option in SPEC.options.items()}
    assert defaults == {
        "allocation": "compiled",  # issue #33
        "floor": 0.25,  # the teacher's
        "repeating_floor": 0.5,  # issue #49
        "sinks": 1,
        "leverage": 0.0,  # issue #49 (it was 2)
        "copy_penalty": 0.25,  # issue #49
        "scores": "predicted",
        "lookahead": "auto",  # issue #74
    }
    assert SPEC.window == 16 and NGRAM == 8 and REPEATING_FRACTION == 0.25
    assert repeats(0.25) and not repeats(0.2499)  # a quarter repeats: the edge is in


def test_the_copy_penalty_lowers_each_token_by_the_later_copies_of_its_8gram_in_one_piece_or_streamed(tiny):
    """The earlier copies of a repeated text give way to the last: a token's log-score drops by `copy_penalty` per
    doubling of the times the 8-gram ending at it occurs again later (a naive count here), streamed or not."""
    hidden = tiny.config.hidden_size
    scorer = DistilledScorer.from_artifact(scorer_that_prefers(tiny, hidden + 1, sign=-1.0))
    ids = torch.randint(3, 90, (20,), generator=torch.Generator().manual_seed(1)).repeat(4)  # 4 copies
    grams = [tuple(ids[i - 7 : i + 1].tolist()) for i in range(7, 80)]
    later = torch.tensor([0] * 7 + [grams[k + 1 :].count(grams[k]) for k in range(len(grams))], dtype=torch.float32)
    plan = Request(ratio=0.5).plan(80, 8, ids)
    states = torch.randn(1, 80, hidden, generator=torch.Generator().manual_seed(2))

    def scores(penalty: float, chunk: int) -> torch.Tensor:
        method, held, carry = Distilled(scorer=scorer, window=8, copy_penalty=penalty), None, None
        for start in range(0, 80, chunk):
            part = states[:, start : start + chunk]
            layer = LayerInputs(
                0, None, None, None, AttentionLogits(1.0), part, start=start, final=start + chunk >= 80, plan=plan
            )
            held, carry = method.stream_scores(layer, held, carry)
        return held

    plain = scores(0.0, 80)
    free = plain[0, 0].isfinite()  # the sink and the window keep their infinite scores
    for chunk in (80, 32):
        penalised = scores(0.25, chunk)
        torch.testing.assert_close(penalised[..., free], (plain - 0.25 * torch.log2(1 + later))[..., free])
        assert torch.equal(penalised[..., ~free], plain[..., ~free])
    assert later[60:].max() == 0 and later[10] == 3 and later[27] == 2  # the last copy keeps its score


def test_a_prefill_keeps_the_last_copy_of_a_repeated_text_under_the_copy_penalty(tiny, tmp_path):
    """Through `compress`: a scorer that prefers the oldest tokens keeps the first copy without the penalty, and with
    a large one only tokens whose 8-gram does not occur again (the first 7 tokens and the last copy), oldest first."""
    path = save_artifact(scorer_that_prefers(tiny, tiny.config.hidden_size + 1, sign=-1.0), tmp_path / "s.safetensors")
    prompt = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(3)).repeat(1, 4)  # 80 tokens
    window = [*range(72, 80)]
    for penalty, expected in ((0.0, [*range(16), *window]), (10.0, [*range(7), *range(60, 69), *window])):
        options = {"allocation": "uniform", "window": 8, "copy_penalty": penalty}
        with kvruntime.compress(tiny, "distilled", budget=24, artifacts=[path], options=options) as session:
            session.prefill(prompt)
        assert all(p.tolist() == expected for layer in session.kept_positions for p in layer[0])


def uniform_shares(rows: int, layers: int) -> torch.Tensor:
    return torch.full((rows, layers), 1 / layers, dtype=torch.float64)


def negative_first_share(layers: int) -> torch.Tensor:
    shares = uniform_shares(2, layers)
    shares[0, :2] += torch.tensor([-2.0, 2.0]) / layers  # the first -1/L, still summing to 1
    return shares


@pytest.mark.parametrize(
    "ratios, shares, message",
    [
        ((0.5, 0.9), lambda n: uniform_shares(1, n), r"shape \[1, {n}\], expected \[2 ratios, {n} layers\]"),
        ((0.5,), lambda n: uniform_shares(1, n + 1), r"shape \[1, {m}\], expected \[1 ratios, {n} layers\]"),
        ((), lambda n: uniform_shares(0, n), r"expected \[0 ratios, {n} layers\]"),
        ((0.9, 0.5), lambda n: uniform_shares(2, n), r"share ratios \[0.9, 0.5\] are not increasing"),
        ((0.5, 0.5), lambda n: uniform_shares(2, n), "are not increasing"),
        ((0.5, 0.9), negative_first_share, "must be non-negative and sum to 1"),
        ((0.5, 0.9), lambda n: uniform_shares(2, n) * 0.9, "must be non-negative and sum to 1"),
    ],
    ids=["a row short", "a layer too many", "no ratios", "decreasing", "a ratio twice", "negative", "sum 0.9"],
)
def test_malformed_compiled_layer_shares_are_refused_when_the_scorer_is_read(tmp_path, ratios, shares, message):
    """The shares the compiled allocation apportions by: one row per ratio, one column per layer, the ratios
    increasing, each row a distribution; a scorer file holding other shares is refused when the method is built."""
    artifact = scorer_that_prefers(tiny_model("llama"), 0)
    layers = artifact.tensors["weights"].shape[0]
    artifact.tensors["layer_shares"] = shares(layers)
    artifact.tensors["share_ratios"] = torch.tensor(ratios, dtype=torch.float64)
    path = save_artifact(artifact, tmp_path / "distilled_scorer.safetensors")
    with pytest.raises(kvruntime.ArtifactError, match=message.format(n=layers, m=layers + 1)):
        kvruntime.get_method("distilled", [kvruntime.read_artifact(path)])


@pytest.mark.parametrize(
    "floor, message",
    [("abc", "share_floor 'abc' is not a number"), (True, "share_floor True is not a number"),
     (1.0, "share_floor 1.0 is not in"), (float("nan"), "share_floor nan is not in")],
)  # fmt: skip
def test_a_recorded_share_floor_that_is_no_floor_is_refused_when_the_scorer_is_read(tmp_path, floor, message):
    artifact = scorer_that_prefers(tiny_model("llama"), 0)
    artifact.params["share_floor"] = floor
    path = save_artifact(artifact, tmp_path / "distilled_scorer.safetensors")
    with pytest.raises(kvruntime.ArtifactError, match=message):
        kvruntime.get_method("distilled", [kvruntime.read_artifact(path)])


def test_question_mode_and_a_scorer_of_another_model_is_refused(tiny, tokens, tmp_path):
    path = save_artifact(scorer_that_prefers(tiny, 0), tmp_path / "s.safetensors")
    with kvruntime.compress(tiny, "distilled", ratio=0.75, artifacts=[path], options={"window": 8}) as session:
        context = session.prefill(tokens)
        output = context.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert output.shape == (1, 6)
    other = save_artifact(scorer_that_prefers(tiny_model("qwen2"), 0), tmp_path / "other.safetensors")
    with pytest.raises(KVRuntimeError, match="compiled for another model"):
        with kvruntime.compress(tiny_model("llama"), "distilled", ratio=0.5, artifacts=[other]):
            pass
    assert isinstance(kvruntime.get_method("distilled", [kvruntime.read_artifact(path)]).scorer, DistilledScorer)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--oracle", "psychic"], "--oracle 'psychic': use one of reconstruction, repeat"),
        (["--prompts", "2"], "--prompts must be at least 4"),
        (["--shares-from", "novels"], "--shares-from 'novels': use one of repeating, all"),
        (["--corpus", "short.txt", "--prompt-tokens", "200"], "too short for 200-token prompts"),
    ],
)
def test_bad_distill_input_is_refused_in_one_line_and_nothing_is_written(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "short.txt").write_text("a few words only. " * 8)
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: (tiny_model("llama"), CharTokenizer()))
    result = runner.invoke(app, ["distill", "--out", "d.safetensors", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["distill", "--device", "tpu"], "--device 'tpu': use cpu, cuda, cuda:N or mps"),
        (["distill", "--dtype", "float64"], "--dtype 'float64': use one of float32, bfloat16, float16"),
        (["tables", "--device", "mps"], "--device 'mps': this command runs on cpu, cuda only"),
        *(
            [
                (["stats", "--device", "cuda:0"], "this machine has no CUDA device"),
                (["tables", "--device", "cuda"], "this machine has no CUDA device"),
            ]
            if not torch.cuda.is_available()
            else []
        ),
    ],
)
def test_devices_and_dtypes_a_command_cannot_use_are_refused_before_the_model_loads(
    args, message, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: pytest.fail("the model was loaded"))
    result = runner.invoke(app, [*args, "--out", "x.safetensors"])
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_the_compiled_layer_shares_average_the_teachers_over_the_prompts_whose_text_repeats(tmp_path):
    """Prompts alternate between a periodic document and a random one; `shares_from` picks which prompts' teacher
    allocations the compiled shares average, and with no repeating prompt the shares are all prompts'."""
    rng = np.random.default_rng(3)
    periodic, random_text = "the quick brown fox. " * 500, "".join(chr(97 + c) for c in rng.integers(0, 26, 9000))
    model, settings = tiny_model("llama"), DistillSettings(prompts=4, prompt_tokens=96, lookahead_queries=0)
    prompts = calibration_prompts(Corpus("two", (periodic, random_text)), CharTokenizer(), 4, 96, 0)
    teacher = [
        distill.teacher_layer_shares(
            distill.prompt_features_and_targets(model, CharTokenizer(), ids, "reconstruction")[1],
            SPEC.window,
            int(SPEC.options["sinks"].default),
            float(SPEC.options["floor"].default),
        )
        for _, ids in prompts
    ]
    expected = {
        ("two", "repeating"): torch.stack(teacher[0::2]).mean(0),  # sources 0, 1, 0, 1: the periodic one repeats
        ("two", "all"): torch.stack(teacher).mean(0),
        ("random", "repeating"): None,  # none repeats: every prompt's
    }
    for (corpus, shares_from), reference in expected.items():
        documents = (periodic, random_text) if corpus == "two" else (random_text,)
        job = CompileJob(model, CharTokenizer(), tmp_path / f"{corpus}_{shares_from}.safetensors")
        compiled = dataclasses.replace(settings, shares_from=shares_from)
        artifact = compile_distilled_scorer(job, Corpus(corpus, documents), compiled)
        if reference is None:
            assert artifact.params["share_prompts"] == "all 4 calibration prompts (none repeats)"
            continue
        torch.testing.assert_close(artifact.tensors["layer_shares"].double(), reference, atol=1e-6, rtol=0)
        assert artifact.params["share_prompts"] == (
            "the 2 of 4 calibration prompts whose text repeats"
            if shares_from == "repeating"
            else "all 4 calibration prompts"
        )
    assert float((expected["two", "repeating"] - expected["two", "all"]).abs().max()) > 1e-3  # the choice matters


def _seen_earlier_share(ids: list[int], n: int) -> float:
    """The reference: walk the prompt, counting each n-gram met before."""
    seen, repeated = set(), 0
    for end in range(n, len(ids) + 1):
        repeated += tuple(ids[end - n : end]) in seen
        seen.add(tuple(ids[end - n : end]))
    return repeated / max(len(ids) - n + 1, 1)


def test_the_repeated_ngram_fraction_counts_the_ngrams_seen_earlier_in_the_prompt():
    share = repeated_ngram_fraction
    assert share(torch.tensor([1, 2, 3, 1, 2, 3]), n=2) == pytest.approx(2 / 5)  # (1,2) (2,3) again of 5
    assert share(torch.tensor([5, 5, 5, 5]), n=2) == pytest.approx(2 / 3)
    assert share(torch.tensor([1, 2, 3]), n=8) == 0.0
    assert share(torch.arange(100)) == 0.0
    generator = torch.Generator().manual_seed(0)
    for vocabulary in (3, 5, 50):
        ids = torch.randint(vocabulary, (300,), generator=generator)
        assert share(ids, n=4) == pytest.approx(_seen_earlier_share(ids.tolist(), 4))
    assert repeats(share(torch.tensor([7, 8, 9] * 40))) and not repeats(share(torch.arange(120)))


def test_a_bfloat16_model_distils_to_finite_weights_close_to_the_float32_ones(scorer, tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    artifact = compile_distilled_scorer(CompileJob(model, CharTokenizer(), tmp_path / "bf16"), CORPUS, DISTILL)
    weights, reference = artifact.tensors["weights"], kvruntime.read_artifact(scorer).tensors["weights"]
    assert bool(torch.isfinite(weights).all()) and weights.dtype == torch.float32
    assert float(torch.nn.functional.cosine_similarity(weights.flatten(), reference.flatten(), dim=0)) > 0.9


def test_question_mode_answers_from_exactly_the_entries_distilled_kept(tiny, tokens, tmp_path):
    """Every answer step's logits are those of the full model attending only to the kept entries (by position)."""
    path = save_artifact(scorer_that_prefers(tiny, 0), tmp_path / "s.safetensors")
    question = torch.tensor([[3, 4, 5, 9]])
    got, reference, report, _ = answer_and_reference(
        tiny,
        tokens,
        question,
        "distilled",
        artifacts=[path],
        ratio=0.75,
        options={"window": 8, "allocation": "dynamic"},
    )
    assert len(set(report.slots_per_layer)) > 1  # the dynamic allocation gave the layers different counts
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


def test_export_kvzap_writes_kvzaps_linear_layers_and_refuses_other_artifacts_in_one_line(tmp_path):
    from safetensors.torch import load_file

    model = tiny_model("llama")
    scorer = scorer_that_prefers(model, 0)
    scorer.tensors["weights"][:, 64] = 0.5  # the bias
    path = save_artifact(scorer, tmp_path / "distilled_scorer.safetensors")
    result = runner.invoke(app, ["export-kvzap", str(path), "--out", str(tmp_path / "kvzap")])
    assert result.exit_code == 0, result.output
    tensors = load_file(tmp_path / "kvzap" / "model.safetensors")
    assert len(tensors) == 2 * 4
    assert torch.equal(tensors["layers.2.weight"], scorer.tensors["weights"][2, :64].T)
    assert torch.equal(tensors["layers.2.bias"], torch.full((2,), 0.5))
    other = save_artifact(
        Artifact("layer_budgets", {"layer_error": torch.ones(4)}, model_fingerprint(model), {}, {}), tmp_path / "b"
    )
    result = runner.invoke(app, ["export-kvzap", str(other), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "takes a distilled_scorer" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.parametrize("sinks", [0, 1, 3])
def test_the_first_sinks_tokens_always_stay_whatever_the_scorer_says(tiny, tokens, tmp_path, sinks):
    """The scorer prefers the newest tokens (log1p(position)): the first `sinks` tokens stay anyway, then the
    newest, streamed or in one piece."""
    path = save_artifact(scorer_that_prefers(tiny, tiny.config.hidden_size + 1), tmp_path / "newest.safetensors")
    length, window = tokens.shape[1], 8
    for chunk in (None, 16):
        options = {"allocation": "uniform", "window": window, "sinks": sinks, "leverage": 0.0}
        with kvruntime.compress(
            tiny, "distilled", ratio=0.5, artifacts=[path], options=options, prefill_chunk_size=chunk
        ) as s:
            s.prefill(tokens)
        keep = kept_per_head(length, window, ratio=0.5)
        expected = [*range(sinks), *range(length - keep + sinks, length)]
        for positions in s.kept_positions:
            assert all(sorted(p.tolist()) == expected for p in positions[0]), (chunk, positions[0, 0].tolist())


def hat_matrix_diagonal(keys: np.ndarray, ridge: float) -> np.ndarray:
    """Each row's leverage under a ridge, from a QR factorisation of the keys stacked on sqrt(lambda) I: with
    A = [K; sqrt(lambda) I] = QR, K (K^T K + lambda I)^-1 K^T = Q_K Q_K^T, so the diagonal is Q_K's row norms."""
    lam = ridge * (keys**2).sum() / keys.shape[1]
    q, _ = np.linalg.qr(np.vstack([keys, np.sqrt(lam) * np.eye(keys.shape[1])]))
    return (q[: keys.shape[0]] ** 2).sum(axis=1)


def test_key_leverage_is_the_ridge_hat_matrix_diagonal_and_ranks_a_repeated_key_below_a_unique_one():
    keys = torch.randn(2, 3, 40, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    keys[0, 0, 10:20] = keys[0, 0, 10]  # one key repeated ten times
    leverage = key_leverage(keys)
    for b in range(2):
        for h in range(3):
            np.testing.assert_allclose(leverage[b, h].numpy(), hat_matrix_diagonal(keys[b, h].numpy(), 1e-4), rtol=1e-4)
    # Ten copies of a key share one direction's leverage; a key alone in its direction has nearly all of its own.
    assert leverage[0, 0, 10:20].max() < 0.5 * leverage[0, 0, 20:].median()
    outlier = keys.clone()
    outlier[1, 2, 5] = 100.0 * torch.nn.functional.normalize(torch.randn(8, dtype=torch.float64), dim=0)
    assert key_leverage(outlier)[1, 2, 5] > 0.99


def test_the_leverage_term_moves_only_the_fresh_unprotected_entries_by_beta_times_their_spread():
    generator = torch.Generator().manual_seed(1)
    scores, keys = torch.randn(1, 2, 30, generator=generator), torch.randn(1, 2, 30, 4, generator=generator)
    scores[..., 0] = scores[..., -3:] = float("inf")  # a sink and the window
    mixed = with_leverage(scores, keys, beta=2.0, fresh=20)
    assert torch.equal(mixed[..., :10], scores[..., :10])  # the held entries keep their scores
    assert torch.equal(mixed[..., -3:], scores[..., -3:])
    moved = (mixed - scores)[..., 10:27]
    spread = scores[..., 10:27].std(-1)
    torch.testing.assert_close(moved.mean(-1), torch.zeros(1, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(moved.std(-1), 2.0 * spread)
    log_leverage = key_leverage(keys).log()[..., 10:27]  # the same order as the leverage among all keys held
    assert torch.equal(moved.argsort(-1), log_leverage.argsort(-1))
    assert torch.equal(with_leverage(scores, keys, beta=0.0, fresh=20), scores)


def kept_with_leverage(model, tokens, folder, chunk, beta, window):
    """What distilled keeps (uniform budgets at ratio 0.5, a scorer preferring the oldest tokens, `leverage` beta;
    streamed in chunks of `chunk` tokens, or whole for None) and the uncompressed prompt's cache (the reference's
    keys)."""
    scorer = scorer_that_prefers(model, model.config.hidden_size + 1, sign=-1.0)
    path = save_artifact(scorer, folder / "oldest.safetensors")
    options = {"allocation": "uniform", "window": window, "leverage": beta}
    with kvruntime.compress(
        model, "distilled", ratio=0.5, artifacts=[path], options=options, prefill_chunk_size=chunk
    ) as session:
        session.prefill(tokens)
    with torch.no_grad():
        return session.kept_positions, model(tokens, use_cache=True).past_key_values


@pytest.mark.parametrize("chunk", [None, 80])
def test_with_leverage_each_head_keeps_the_tokens_of_its_best_mixed_score_among_the_keys_of_the_prompt(
    tiny, tokens, tmp_path, chunk
):
    """Reference: the uncompressed prompt's keys per layer, their leverage from the QR above, z-scored over the
    unprotected tokens and added at beta x the spread to the scorer's -log1p(position); the top of each head under
    uniform budgets, with the sink and the window. A chunk as long as the prompt takes the streamed path."""
    beta, window = 2.0, 8
    kept_positions, cache = kept_with_leverage(tiny, tokens, tmp_path, chunk, beta, window)
    length = tokens.shape[1]
    free = np.arange(1, length - window)
    base = -np.log1p(free.astype(np.float64))
    keep = kept_per_head(length, window, ratio=0.5)
    for layer, positions in enumerate(kept_positions):
        for head in range(positions.shape[1]):
            log_leverage = np.log(hat_matrix_diagonal(cache.layers[layer].keys[0, head].double().numpy(), 1e-4))[free]
            z = (log_leverage - log_leverage.mean()) / log_leverage.std(ddof=1)
            mixed = base + beta * base.std(ddof=1) * z
            order = np.argsort(-mixed)
            assert mixed[order[keep - window - 2]] - mixed[order[keep - window - 1]] > 1e-4  # no near tie at the cut
            expected = {0, *free[order[: keep - window - 1]].tolist(), *range(length - window, length)}
            assert set(positions[0, head].tolist()) == expected, (layer, head)


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"leverage": -1.0}, r"distilled option leverage=-1.0: give a value at least 0.0"),
        ({"leverage": math.nan}, "distilled option leverage=nan is not finite"),
        ({"floor": math.inf}, "distilled option floor=inf is not finite"),
        ({"floor": 1.5}, r"distilled option floor=1.5: give a value in \[0.0, 1.0\]"),
    ],
)
def test_a_value_outside_an_options_range_or_not_finite_is_refused_in_a_method_built_by_hand_too(options, refusal):
    with pytest.raises(kvruntime.KVRuntimeError, match=refusal):  # when it is used (compress takes it here)
        get_method(Distilled(scorer=DistilledScorer(torch.zeros(1, 1, 1), "test"), **options))


def test_streamed_with_leverage_each_chunk_is_ranked_among_the_keys_held_and_the_held_keep_their_scores(
    tiny, tokens, tmp_path
):
    """Chunks of 16: a by-hand replay of the cuts for layer 0 (its keys depend on the tokens alone, so the
    uncompressed forward gives them): each chunk's tokens get their leverage among the keys held then plus the
    chunk's, z-scored over the chunk's unprotected tokens; the held entries keep the scores they came with."""
    beta, window, chunk = 2.0, 8, 16
    kept_positions, cache = kept_with_leverage(tiny, tokens, tmp_path, chunk, beta, window)
    keys = cache.layers[0].keys[0].double().numpy()
    length = tokens.shape[1]
    budget = kept_per_head(length, window, ratio=0.5)
    for head in range(keys.shape[0]):
        held: dict[int, float] = {}
        for start in range(0, length, chunk):
            fresh = np.arange(start, start + chunk)
            present = [*held, *fresh.tolist()]
            log_leverage = np.log(hat_matrix_diagonal(keys[head, present], 1e-4))[-chunk:]
            protected = (fresh == 0) | ((start + chunk == length) & (fresh >= length - window))
            base = -np.log1p(fresh.astype(np.float64))
            free = ~protected
            z = (log_leverage[free] - log_leverage[free].mean()) / log_leverage[free].std(ddof=1)
            scores = np.where(protected, np.inf, base)
            scores[free] += beta * base[free].std(ddof=1) * z
            held.update(zip(fresh.tolist(), scores.tolist()))
            held = dict(sorted(held.items(), key=lambda item: -item[1])[:budget])
        assert set(kept_positions[0][0, head].tolist()) == set(held), head


def test_the_default_allocation_refuses_a_scorer_without_compiled_layer_shares_in_one_line(tiny, tokens, tmp_path):
    """A scorer compiled before the layer shares existed: the default (compiled shares) names the fix; the dynamic
    allocation and the error-aware budgets need no shares."""
    scorer = scorer_that_prefers(tiny, 0)
    for name in ("share_ratios", "layer_shares"):
        del scorer.tensors[name]
    path = save_artifact(scorer, tmp_path / "old.safetensors")
    with pytest.raises(KVRuntimeError, match="holds no compiled layer shares .* or use allocation=dynamic") as refused:
        with kvruntime.compress(tiny, "distilled", ratio=0.5, artifacts=[path]) as session:
            session.prefill(tokens)
    assert "\n" not in str(refused.value)
    with kvruntime.compress(tiny, "distilled", ratio=0.5, artifacts=[path], options={"allocation": "dynamic"}) as s:
        s.prefill(tokens)
    assert s.report.bytes_after == pytest.approx(s.report.bytes_before / 2, rel=0.02)
