"""kvcompile eval and tune, without the default model: the scores, the contestants, the run records, the
answer path on tiny models, the tuning choice and the runtime's tuned defaults."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import tiny_model

import kvruntime
from kvcompile.calibration.corpus import Corpus
from kvcompile.evaluation import contestants as contestants_module
from kvcompile.evaluation.contestants import FullCache, RuntimeMethod, artifact_paths, parse_methods
from kvcompile.evaluation.metrics import (
    accuracy_auc,
    answer_kl,
    bootstrap_interval,
    greedy_agreement,
    largest_ratio_within,
    next_token_kl,
)
from kvcompile.evaluation.report import (
    FIDELITY_MEASURES,
    by_text_type_table,
    paired_accuracy_table,
    paired_auc_table,
    paired_by_ratio,
    results_table,
    summary_table,
)
from kvcompile.evaluation.runner import Scoring, answer, answer_logprob, scored_tokens, stop_tokens
from kvcompile.evaluation.settings import SuiteSettings
from kvcompile.evaluation.store import RunStore
from kvcompile.evaluation.suite_run import run_order
from kvcompile.recipes.tuned_defaults.tuning import recommendation
from kvcompile.tasks.grid import parse_tasks, suite_cells
from kvruntime import Request
from kvruntime.artifacts.artifact import Artifact, save_artifact
from kvruntime.artifacts.fingerprint import model_fingerprint
from kvruntime.errors import KVRuntimeError
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.attention import per_layer_attention


# -- scores ------------------------------------------------------------------------------------------------
def test_next_token_kl_is_the_kl_divergence_of_the_two_distributions():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=generator), torch.randn(50, generator=generator)
    expected = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=a), torch.distributions.Categorical(logits=b)
    )
    assert next_token_kl(a, b) == pytest.approx(float(expected), rel=1e-6)
    assert next_token_kl(a, a + 3.0) == pytest.approx(0.0, abs=1e-9)  # a shift of the logits is the same distribution
    assert next_token_kl(a, b) != pytest.approx(next_token_kl(b, a))  # full cache first: not symmetric


def test_greedy_agreement_counts_the_matching_prefix():
    reference = list(range(40))
    assert greedy_agreement(reference, reference) == 1.0
    assert greedy_agreement(reference, reference[:5] + [99] + reference[6:]) == 5 / 32
    assert greedy_agreement(reference, reference[:10]) == 10 / 32  # the compressed answer stopped early
    assert greedy_agreement([7, 8, 2], [7, 8, 2, 5]) == 1.0  # the full cache's answer ended (EOS) after 3 tokens
    assert greedy_agreement([1, 2, 3], [9, 2, 3]) == 0.0


def test_accuracy_auc_and_the_largest_ratio_within_tolerance():
    assert accuracy_auc(0.8, {0.5: 0.8, 0.9: 0.8}) == pytest.approx(0.8)
    assert accuracy_auc(1.0, {0.5: 1.0, 1.0: 0.0}) == pytest.approx(0.75)
    assert accuracy_auc(1.0, {0.5: 0.5}) == pytest.approx(0.75)
    curve = {0.5: 0.80, 0.6: 0.79, 0.7: 0.70, 0.8: 0.80}
    assert largest_ratio_within(0.80, curve, 0.02) == 0.6  # 0.8 passes again, but after a failure
    assert largest_ratio_within(0.80, curve, 0.2) == 0.8
    assert largest_ratio_within(0.80, {0.5: 0.5}, 0.02) is None


# -- contestants -----------------------------------------------------------------------------------------
def test_methods_parse_with_options_and_the_full_cache_first():
    parsed = parse_methods("kvcompose:mode=dynamic:unstructured=true,compilerkv,snapkv+error-aware")
    assert [c.label for c in parsed] == [
        "full",
        "kvcompose:mode=dynamic:unstructured=true",
        "compilerkv",
        "snapkv+error-aware",
    ]
    assert parsed[1].options == {"mode": "dynamic", "unstructured": True}
    assert parsed[2].options == {}  # a ratio runs the nearest compiled budget's tables without an option
    assert parsed[1].artifact_kinds() == [] and parsed[3].artifact_kinds() == ["layer_budgets"]
    streamed = parse_methods("snapkv,snapkv:prefill_chunk_size=256,distilled:allocation=uniform:prefill_chunk_size=64")
    assert [c.prefill_chunk_size for c in streamed[1:]] == [None, 256, 64]
    assert streamed[3].options == {"allocation": "uniform"}  # the chunk size goes to the engine, not the method


@pytest.mark.parametrize(
    "methods, message",
    [
        ("h2o", "unknown method 'h2o'"),
        ("snapkv,snapkv", "names a method twice"),
        ("full", "names no method"),
        ("kvcompose:mode", "write it as key=value"),
        ("kvpress-h2o", "unknown kvpress press 'h2o'"),
        ("snapkv:prefill_chunk_size=0", "prefill_chunk_size must be a positive number of tokens"),
        ("snapkv:prefill_chunk_size=12.5", "prefill_chunk_size must be a positive number of tokens"),
    ],
)
def test_bad_methods_are_refused(methods, message):
    with pytest.raises(KVRuntimeError, match=message):
        parse_methods(methods)


def test_kvpress_presses_without_the_bench_extra_say_how_to_get_it(monkeypatch):
    monkeypatch.setattr(contestants_module, "kvpress_available", lambda: False)
    with pytest.raises(KVRuntimeError, match="needs kvpress: install the bench extra"):
        parse_methods("kvpress-snapkv")
    assert "kvpress" not in contestants_module.default_methods()


def test_a_missing_artifact_is_refused_with_the_command_that_compiles_it(tmp_path):
    with pytest.raises(
        KVRuntimeError,
        match=r"compresskv: .*no srh_heads artifact in this folder \(expected .*srh_heads.safetensors\); compile it with `kvcompile heads`",
    ):
        artifact_paths(parse_methods("compresskv"), (tmp_path,))


def test_a_method_takes_its_artifacts_from_its_own_folder_when_given(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "distilled_scorer.safetensors").touch()
    (other / "distilled_scorer.safetensors").touch()
    parsed = parse_methods(f"distilled,distilled:artifacts={other}:scores=oracle")
    assert parsed[2].options == {"scores": "oracle"} and parsed[2].artifacts == other
    paths = artifact_paths(parsed, (tmp_path,))
    assert paths["distilled"] == [tmp_path / "distilled_scorer.safetensors"]
    assert paths[f"distilled:artifacts={other}:scores=oracle"] == [other / "distilled_scorer.safetensors"]
    with pytest.raises(KVRuntimeError, match="artifacts=.*missing is not a folder"):
        parse_methods(f"distilled:artifacts={tmp_path / 'missing'}")


def test_kvzap_needs_its_checkpoint_and_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setattr(contestants_module, "kvpress_available", lambda: True)
    assert "kvzap" not in [c.press_name for c in parse_methods("kvpress")[1:]]  # needs a checkpoint: named on its own
    with pytest.raises(KVRuntimeError, match=r"kvpress-kvzap needs the checkpoint .*kvzap_linear: distil it with"):
        artifact_paths(parse_methods("kvpress-kvzap"), (tmp_path,))
    (tmp_path / "kvzap_linear").mkdir()
    (tmp_path / "kvzap_linear" / "config.json").write_text("{}")
    assert artifact_paths(parse_methods("kvpress-kvzap"), (tmp_path,))["kvpress-kvzap"] == [tmp_path / "kvzap_linear"]


# -- run records ---------------------------------------------------------------------------------------
def test_run_records_resume_only_the_same_run(tmp_path):
    store = RunStore(tmp_path, {"ratios": [0.5]}, resume=False)
    store.add([{"prompt": 0, "method": "full", "ratio": 0.0, "correct": 1}])
    with pytest.raises(KVRuntimeError, match="pass --resume to continue it"):
        RunStore(tmp_path, {"ratios": [0.5]}, resume=False)
    with pytest.raises(KVRuntimeError, match=r"other settings \(ratios differ\)"):
        RunStore(tmp_path, {"ratios": [0.9]}, resume=True)
    resumed = RunStore(tmp_path, {"ratios": [0.5]}, resume=True)
    assert resumed.done(0, "full", 0.0) and not resumed.done(1, "full", 0.0)
    assert not list(tmp_path.glob(".*.tmp"))


def test_methods_may_be_added_to_a_run_but_not_dropped(tmp_path):
    store = RunStore(tmp_path, {"methods": ["full", "snapkv"], "ratios": [0.5]}, resume=False, extendable=("methods",))
    store.add([{"prompt": 0, "method": "snapkv", "ratio": 0.5, "correct": 1}])
    grown = RunStore(
        tmp_path, {"methods": ["full", "snapkv", "tova"], "ratios": [0.5]}, resume=True, extendable=("methods",)
    )
    assert grown.done(0, "snapkv", 0.5) and not grown.done(0, "tova", 0.5)
    with pytest.raises(KVRuntimeError, match=r"methods differ"):
        RunStore(tmp_path, {"methods": ["full", "tova"], "ratios": [0.5]}, resume=True, extendable=("methods",))
    with pytest.raises(KVRuntimeError, match=r"methods differ"):
        RunStore(tmp_path, {"methods": ["full", "snapkv", "tova"], "ratios": [0.5]}, resume=True)


def test_tables_group_by_method_ratio_task_and_length():
    records = [
        dict(
            prompt=p,
            task=t,
            length=1024,
            method=m,
            ratio=r,
            correct=c,
            kl=k,
            agreement=1.0 - k,
            prefill_vs_full=1.0,
            peak_mib=None,
            cache_kept=1.0 - r,
        )
        for p, t in ((0, "passkey"), (1, "qa"))
        for m, r, c, k in (("full", 0.0, 1, 0.0), ("snapkv", 0.5, p, 0.2), ("snapkv", 0.9, 0, 0.5))
    ]
    table = results_table(records)
    assert len(table) == 6 and {r["prompts"] for r in table} == {1}
    summary = {(r["method"], r["ratio"]): r for r in summary_table(records)}
    assert summary[("snapkv", 0.5)]["accuracy"] == 0.5 and summary[("snapkv", 0.9)]["kl"] == 0.5
    # full 1.0 at 0, 0.5 at 0.5, 0 at 0.9: ((1 + 0.5) / 2 * 0.5 + (0.5 + 0) / 2 * 0.4) / 0.9
    assert summary[("snapkv", 0.5)]["auc"] == pytest.approx((0.375 + 0.1) / 0.9, abs=1e-4)


# -- answers on tiny models ------------------------------------------------------------------------------
class DigitTokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(int(i)) for i in ids)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_full_cache_answers_as_plain_generate_and_a_compressed_run_holds_less(kind, tokens):
    model = tiny_model(kind)
    context_ids, question_ids = tokens[:, :70], tokens[:, 70:]
    gold = [5, 17, 42]
    scoring = Scoring(None, gold)
    full = answer(model, DigitTokenizer(), FullCache(), 0.0, context_ids, question_ids, 8, [], scoring)
    plain = model.generate(tokens, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert full.tokens == plain[0, 80:].tolist()
    logits = model(tokens).logits[0, -1]
    assert torch.allclose(full.first_logits, logits, atol=1e-4)
    # Teacher forcing, against one plain forward over the whole sequence: the full cache's own answer (all 8
    # tokens: the tiny model has no stop token) and the expected answer's log-probability.
    own = scored_tokens(full.tokens, stop_tokens(model))
    assert own == full.tokens
    with torch.no_grad():
        plain_forced = model(torch.cat([tokens, torch.tensor([own[:-1]])], dim=1)).logits[0, 79:]
        gold_logits = model(torch.cat([tokens, torch.tensor([gold[:-1]])], dim=1)).logits[0, 79:]
    assert torch.allclose(full.reference_logits, plain_forced, atol=1e-4)
    by_hand = sum(torch.log_softmax(gold_logits[i].double(), -1)[t] for i, t in enumerate(gold))
    assert full.gold_logprob == pytest.approx(float(by_hand), abs=1e-4)
    on_full = Scoring(own, gold)
    snapkv = RuntimeMethod("snapkv", "snapkv").resolved([], [Request(ratio=0.0), Request(ratio=0.5)])
    same = answer(model, DigitTokenizer(), snapkv, 0.0, context_ids, question_ids, 8, [], on_full)
    assert same.tokens == full.tokens and next_token_kl(full.first_logits, same.first_logits) < 1e-8
    assert answer_kl(full.reference_logits, same.reference_logits) < 1e-8
    assert same.gold_logprob == pytest.approx(full.gold_logprob, abs=1e-4)
    half = answer(model, DigitTokenizer(), snapkv, 0.5, context_ids, question_ids, 8, [], on_full)
    assert half.cache_bytes == pytest.approx(full.cache_bytes / 2, rel=0.02)
    assert full.prefill_seconds > 0 and half.prefill_seconds > 0
    assert answer_kl(full.reference_logits, half.reference_logits) > 1e-4  # half the context: it differs
    # Teacher-forced on its own greedy answer, the compressed context predicts each of its tokens as generate did.
    own_half = answer(model, DigitTokenizer(), snapkv, 0.5, context_ids, question_ids, 8, [], scoring)
    assert own_half.tokens == half.tokens
    assert torch.allclose(own_half.reference_logits[0], half.first_logits, atol=1e-4)
    assert own_half.reference_logits.argmax(dim=-1).tolist() == half.tokens


def test_the_answer_kl_averages_the_kl_of_each_token_and_the_logprob_sums_the_tokens():
    reference = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    compressed = torch.log(torch.tensor([[0.5, 0.5], [0.6, 0.4]]))
    second = 0.9 * torch.log(torch.tensor(0.9 / 0.6)) + 0.1 * torch.log(torch.tensor(0.1 / 0.4))
    assert answer_kl(reference, compressed) == pytest.approx(float(second) / 2, abs=1e-6)
    assert answer_kl(reference, reference) == 0.0
    assert answer_logprob(compressed, [1, 0]) == pytest.approx(float(torch.log(torch.tensor(0.5 * 0.6))), abs=1e-6)


def test_fidelity_is_paired_per_ratio_as_log_kl_and_expected_answer_logprob():
    """By hand: the subject's log(KL + 1e-4) and log-probabilities minus the other's, prompt by prompt."""
    kls = {"distilled": [0.01, 0.1, 0.0], "compactor": [0.1, 0.1, 0.0099]}
    logprobs = {"distilled": [-1.0, -2.0, -3.0], "compactor": [-1.5, -2.0, -2.0]}
    records = [
        dict(prompt=p, method=m, ratio=0.5, correct=1, answer_kl=kls[m][p], answer_logprob=logprobs[m][p])
        for m in kls
        for p in range(3)
    ]
    (row,) = paired_by_ratio(records, "distilled", FIDELITY_MEASURES["log_answer_kl"])
    expected = [math.log(0.0101 / 0.1001), 0.0, math.log(0.0001 / 0.01)]
    assert row["distilled_minus_method"] == pytest.approx(sum(expected) / 3, abs=1e-4)
    assert (row["distilled_higher"], row["method_higher"], row["prompts"]) == (0, 2, 3)  # higher KL: less faithful
    (row,) = paired_by_ratio(records, "distilled", FIDELITY_MEASURES["answer_logprob"])
    assert row["distilled_minus_method"] == pytest.approx((0.5 + 0.0 - 1.0) / 3, abs=1e-4)


def test_fidelity_per_text_type_pairs_each_type_apart():
    """By hand: filler prompts 0-1 and code prompts 2-3 (their tasks' text types); a pooled mean would hide that
    the subject is the more faithful on filler and the less on code."""
    tasks = ["passkey", "needle_filler", "code_signature", "code_continuation"]
    kls = {"distilled": [0.0099, 0.0099, 0.9999, 0.4999], "compactor": [0.0999, 0.0999, 0.0999, 0.0999]}
    correct = {"distilled": [1, 1, 0, 0.5], "compactor": [1, 0, 1, 1]}
    records = [
        dict(
            prompt=p, task=tasks[p], method=m, ratio=0.9, correct=correct[m][p], answer_kl=kls[m][p], answer_logprob=-p
        )
        for m in kls
        for p in range(4)
    ]
    code, filler = by_text_type_table(records, "distilled")
    assert (code["text"], filler["text"], code["method"], code["prompts"]) == ("code", "filler", "compactor", 2)
    assert filler["log_answer_kl"].startswith(f"{math.log(0.01 / 0.1):+.2f} (")
    assert code["log_answer_kl"].startswith(f"{(math.log(1.0 / 0.1) + math.log(0.5 / 0.1)) / 2:+.2f} (")
    assert code["answers"].startswith("-0.75 (") and filler["answers"].startswith("+0.50 (")
    assert (code["answers_of_each"], filler["answers_of_each"]) == ("0.5 / 2", "2 / 1")
    assert code["answer_logprob"] == "+0.00 (+0.00..+0.00)"


# -- tuning and the runtime's tuned defaults -----------------------------------------------------------
SETTINGS = SuiteSettings(
    ratios=(0.5, 0.75, 0.9), tasks=("passkey",), lengths=(1024,), samples=2, seed=1, question_aware=False, new_tokens=48
)


def coin_mean_quantile(flips: int, q: float) -> float:
    """The q-quantile of the mean of `flips` fair coin flips, from the binomial distribution by hand."""
    total = 0.0
    for heads in range(flips + 1):
        total += math.comb(flips, heads) / 2**flips
        if total >= q:
            return heads / flips
    return 1.0


def test_the_bootstrap_interval_of_a_mean_is_the_exact_resampling_quantile_and_exact_without_spread():
    """Resampling 200 zeros and 200 ones with replacement draws 400 fair coins: the 95% interval is the binomial
    2.5% and 97.5% quantiles of their mean (0.451, 0.549), within a step of 1/400 and the Monte Carlo error of
    10,000 resamples (sd 0.0007); a 90% interval (0.459, 0.541) is 0.008 off and fails."""
    assert bootstrap_interval([0.25] * 30) == (0.25, 0.25)
    low, high = bootstrap_interval([0.0, 1.0] * 200)
    assert low == pytest.approx(coin_mean_quantile(400, 0.025), abs=0.0045)
    assert high == pytest.approx(coin_mean_quantile(400, 0.975), abs=0.0045)
    assert bootstrap_interval([0.0, 1.0, 0.5]) == bootstrap_interval([0.0, 1.0, 0.5])  # seeded


def test_paired_auc_differences_average_to_the_suite_auc_difference_and_count_who_is_higher():
    ratios = (0.5, 0.75, 0.9)
    correct = {  # per method, per prompt, the answers at each ratio
        "distilled": [(1, 1, 0), (1, 0, 0), (1, 1, 1)],
        "tova": [(1, 1, 1), (0, 0, 0), (1, 1, 1)],
    }
    records = [dict(prompt=p, method="full", ratio=0.0, correct=1, kl=0.0) for p in range(3)]
    for method, prompts in correct.items():
        records += [
            dict(prompt=p, method=method, ratio=r, correct=c, kl=0.0)
            for p, answers in enumerate(prompts)
            for r, c in zip(ratios, answers)
        ]
    # by hand, the trapezoid through 1 at ratio 0, over 0.9: prompt 0 areas 0.825 vs 0.9 (tova keeps 0.9's answer),
    # prompt 1 areas 0.5 + 0.125 vs 0.25, prompt 2 the same answers
    expected = [-0.075 / 0.9, (0.625 - 0.25) / 0.9, 0.0]
    (row,) = paired_auc_table(records, "distilled")
    assert row["method"] == "tova" and row["prompts"] == 3
    assert row["distilled_minus_method"] == pytest.approx(sum(expected) / 3, abs=1e-4)
    filler = dict(agreement=1.0, prefill_vs_full=1.0, peak_mib=None, cache_kept=1.0)
    auc = {r["method"]: r["auc"] for r in summary_table([{**r, **filler} for r in records])}
    assert row["distilled_minus_method"] == pytest.approx(auc["distilled"] - auc["tova"], abs=2e-4)
    assert (row["distilled_higher"], row["method_higher"]) == (1, 1)
    assert row["low_95"] <= row["distilled_minus_method"] <= row["high_95"]
    # At each ratio, by hand from the answers above: 0.5 (1,1,1) vs (1,0,1), 0.75 the same, 0.9 (0,0,1) vs (1,0,1).
    by_ratio = {r["ratio"]: r for r in paired_accuracy_table(records, "distilled")}
    assert list(by_ratio) == list(ratios) and all(
        r["method"] == "tova" and r["prompts"] == 3 for r in by_ratio.values()
    )
    assert [by_ratio[r]["distilled_minus_method"] for r in ratios] == [round(1 / 3, 4), 0.0, round(-1 / 3, 4)]
    assert [(by_ratio[r]["distilled_higher"], by_ratio[r]["method_higher"]) for r in ratios] == [(1, 0), (0, 0), (0, 1)]
    assert by_ratio[0.75]["low_95"] == by_ratio[0.75]["high_95"] == 0.0


def test_a_run_goes_sample_by_sample_so_that_a_run_stopped_early_covers_every_task_and_length():
    settings = dataclasses.replace(
        SETTINGS, tasks=("passkey", "needle", "qa"), lengths=(1024, 2048), samples=3, task_samples={"needle": 1}
    )
    # the suite's prompt order (suite_prompts): task by task, length by length, sample by sample
    counts = {"passkey": 3, "needle": 1, "qa": 3}
    cells = [(t, n, s) for t in settings.tasks for n in settings.lengths for s in range(counts[t])]
    assert suite_cells(settings.tasks, settings.lengths, settings.samples_per_task) == [
        (*c, counts[c[0]]) for c in cells
    ]
    order = [cells[i] for i in run_order(list(range(len(cells))), settings)]
    assert order[:6] == [(t, n, 0) for n in (1024, 2048) for t in ("passkey", "needle", "qa")]
    assert sorted(order) == sorted(cells) and [s for _, _, s in order] == sorted(s for _, _, s in cells)
    assert order[6:] == [(t, n, s) for s in (1, 2) for n in (1024, 2048) for t in ("passkey", "qa")]


@pytest.mark.parametrize(
    "text, tasks, counts",
    [
        ("passkey, qa:2 ,common_words:3", ("passkey", "qa", "common_words"), {"qa": 2, "common_words": 3}),
        ("needle", ("needle",), {}),
    ],
)
def test_tasks_may_carry_their_own_prompt_counts(text, tasks, counts):
    assert parse_tasks(text) == (tasks, counts)


@pytest.mark.parametrize("text", ["qa:0", "qa:two", "ruler:2", ""])
def test_bad_task_counts_are_refused_in_one_line(text):
    with pytest.raises(KVRuntimeError, match="--tasks|unknown tasks"):
        parse_tasks(text)


def tuning_records(accuracies: dict[str, list[float]], full: float = 1.0) -> list[dict]:
    """Two prompts per cell; a method's curve stops after its first ratio out of a 0.02 tolerance, as tune does."""
    records = [dict(prompt=p, method="full", ratio=0.0, correct=int(p < 2 * full), kl=0.0) for p in range(2)]
    for label, curve in accuracies.items():
        for ratio, accuracy in zip(SETTINGS.ratios, curve):
            records += [
                dict(prompt=p, method=label, ratio=ratio, correct=int(p < 2 * accuracy), kl=ratio) for p in range(2)
            ]
    return records


def tuned(tmp_path, accuracies, methods="snapkv,kvcompress,compresskv", artifacts=None, full=1.0):
    model = tiny_model("llama")
    contestants = parse_methods(methods)
    artifact = recommendation(
        model,
        contestants,
        artifacts or {},
        SETTINGS,
        0.02,
        tuning_records(accuracies, full),
        Corpus("validation", ("text",)),
    )
    return model, save_artifact(artifact, tmp_path / "tuned_defaults.safetensors")


def test_tune_recommends_the_method_with_the_largest_ratio_within_tolerance(tmp_path):
    _, path = tuned(tmp_path, {"snapkv": [1.0, 0.5], "kvcompress": [1.0, 1.0, 0.5], "compresskv": [0.5]})
    artifact = kvruntime.read_artifact(path)
    assert artifact.tensors["chosen_ratio"].tolist() == [0.5, 0.75, -1.0]
    assert artifact.tensors["accuracy"][0].tolist() == [1.0, 0.5, -1.0]  # -1: not measured (the method had stopped)
    assert artifact.params["recommended"]["method"] == "kvcompress" and artifact.params["recommended"]["ratio"] == 0.75


def test_tune_breaks_a_tie_of_ratios_by_accuracy(tmp_path):
    # Full cache 0.5: both pass at 0.5 and fail at 0.75; compresskv is more accurate at 0.5.
    _, path = tuned(tmp_path, {"snapkv": [0.5, 0.0], "kvcompress": [0.0], "compresskv": [1.0, 0.0]}, full=0.5)
    artifact = kvruntime.read_artifact(path)
    assert artifact.tensors["chosen_ratio"].tolist() == [0.5, -1.0, 0.5]
    assert artifact.params["recommended"]["method"] == "compresskv"


def test_the_runtime_takes_the_tuned_method_ratio_and_artifacts(tmp_path, tokens):
    model = tiny_model("llama")
    fingerprint = model_fingerprint(model)
    folder = tmp_path / "artifacts"
    srh = save_artifact(
        Artifact("srh_heads", {"srh_score": torch.rand(4, 4)}, fingerprint, {"seed": 0}),
        folder / "srh_heads.safetensors",
    )
    budgets = save_artifact(
        Artifact("layer_budgets", {"layer_error": torch.rand(4) + 0.1}, fingerprint, {"seed": 0}),
        folder / "layer_budgets.safetensors",
    )
    artifacts = {"compresskv": [srh, budgets]}
    _, path = tuned(folder, {"snapkv": [0.0], "kvcompress": [0.0], "compresskv": [1.0, 0.0]}, artifacts=artifacts)
    assert kvruntime.read_artifact(path).params["recommended"]["artifacts"] == [
        "srh_heads.safetensors",
        "layer_budgets.safetensors",
    ]
    with kvruntime.compress(model, artifacts=[path]) as session:
        session.prefill(tokens)
    assert session.method.name == "compresskv" and session.ratio == 0.5
    assert session.report.bytes_after == pytest.approx(session.report.bytes_before / 2, rel=0.05)
    with kvruntime.compress(model, "snapkv", ratio=0.9, artifacts=[path]) as session:  # an explicit choice wins
        session.prefill(tokens)
    assert session.method.name == "snapkv" and session.ratio == 0.9
    with kvruntime.compress(model, ratio=0.25, artifacts=[path]) as session:  # so does an explicit ratio
        pass
    assert session.ratio == 0.25


def test_options_given_with_tuned_defaults_join_the_tuned_method_s_own(tmp_path, tokens):
    """`kvcompile generate --nearest-budget` without --method: the option goes to the tuned method beside the
    options the tuning chose for it (it used to replace them)."""
    from test_compilerkv_runtime import save_tables

    model = tiny_model("llama")
    tables = save_tables(model, tmp_path)
    _, path = tuned(tmp_path, {"compilerkv": [1.0, 0.0]}, methods="compilerkv", artifacts={"compilerkv": [tables]})
    artifact = kvruntime.read_artifact(path)
    artifact.params["recommended"]["options"] = {"elastic": True}
    path = save_artifact(artifact, path)
    with kvruntime.compress(model, artifacts=[path], budget=40, options={"nearest_budget": True}) as session:
        session.prefill(tokens)
    assert session.method.name == "compilerkv" and session.method.elastic and session.method.nearest_budget


def test_tuned_defaults_without_a_recommendation_are_refused_with_the_reason(tmp_path):
    model, path = tuned(tmp_path, {"snapkv": [0.0], "kvcompress": [0.5], "compresskv": [0.0]})
    with pytest.raises(KVRuntimeError, match="tuning found no method within 0.02"):
        with kvruntime.compress(model, artifacts=[path]):
            pass
    other = tiny_model("qwen2")  # the request resolves (a method named), its artifacts then meet the model
    with pytest.raises(KVRuntimeError, match="compiled for"):
        with kvruntime.compress(other, "snapkv", ratio=0.5, artifacts=[path]):
            pass
    assert json.loads(json.dumps(kvruntime.read_artifact(path).params))["recommended"] is None


def test_a_masking_press_is_answered_through_keep_masks_and_held_bytes_count_its_densest_head(tokens):
    """kvpress's KVzip hides entries through `masked_key_indices` on the attention modules: hiding them must answer
    as removing them does, the scoring pass's extra entries must be freed, and the bytes held are each layer's
    largest per-head count."""
    from transformers import DynamicCache

    from kvcompile.evaluation.prefill import held_bytes, keep_mask_hooks, press_keep_masks
    from kvruntime.plumbing.cache_ops import cache_bytes, keep_entries

    model = tiny_model("llama")
    context_ids, question_ids = tokens[:, :70], tokens[:, 70:]
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=context_ids, past_key_values=cache, use_cache=True)
        model(input_ids=question_ids, past_key_values=caches[0], use_cache=True)  # a scoring pass left behind
    hidden = torch.arange(10, 40)
    heads = caches[0].layers[0].keys.shape[1]
    for module in model_layout(model).cut_modules:
        module.masked_key_indices = (
            torch.zeros(heads * 30, dtype=torch.long),
            torch.arange(heads).repeat_interleave(30),
            hidden.repeat(heads),
        )
    masks = press_keep_masks(model, caches[0], 70)
    assert all(not hasattr(m, "masked_key_indices") for m in model_layout(model).cut_modules)
    full_bytes = cache_bytes(caches[1])
    assert cache_bytes(caches[0]) == full_bytes  # the scoring pass's entries are freed
    assert held_bytes(caches[0], masks) == pytest.approx(full_bytes * 40 / 70, rel=1e-3)
    one_head_hides_more = {index: mask.clone() for index, mask in masks.items()}
    one_head_hides_more[0][0, 0, :5] = False  # the layer's densest head still holds 40
    assert held_bytes(caches[0], one_head_hides_more) == held_bytes(caches[0], masks)
    kept = torch.tensor([p for p in range(70) if p not in hidden.tolist()])
    for layer in caches[1].layers:
        keep_entries(layer, kept.expand(1, heads, -1))
    logits = []
    for cache, layer_masks in zip(caches, (masks, {})):
        with per_layer_attention(model), keep_mask_hooks(model, layer_masks):
            out = kvruntime.generate_after_context(
                model, cache, 70, question_ids, max_new_tokens=1, output_logits=True, return_dict_in_generate=True
            )
        logits.append(out.logits[0][0])
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
