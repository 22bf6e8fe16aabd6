"""kvcompile eval and tune end to end on the real default model, on a small grid (about a minute)."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvruntime
from kvcompile.cli import app
from kvcompile.evaluation import suite_run
from kvcompile.recipe import artifact_folder, read_run_record

pytestmark = pytest.mark.integration
runner = CliRunner()
SMALL = ["--tasks", "passkey,qa", "--lengths", "512", "--samples", "1", "--ratios", "0.5", "--new-tokens", "16"]


def rows(path) -> list[dict]:
    with open(path) as handle:
        return list(csv.DictReader(handle))


def test_eval_writes_tables_plots_and_records_and_resumes(tmp_path, default_model, monkeypatch):
    monkeypatch.setattr("kvcompile.recipe.load_model", lambda model, **_: default_model)
    out = tmp_path / "eval"
    args = ["eval", "--methods", "snapkv,kvcompose:unstructured=true", *SMALL, "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    table = rows(out / "results.csv")
    assert {(r["method"], r["task"]) for r in table} == {
        (m, t) for m in ("full", "snapkv", "kvcompose:unstructured=true") for t in ("passkey", "qa")
    }
    full = [r for r in table if r["method"] == "full"]
    assert all(float(r["kl"]) == 0 and float(r["agreement"]) == 1 and float(r["cache_kept"]) == 1 for r in full)
    snapkv = [r for r in table if r["method"] == "snapkv"]
    assert all(float(r["cache_kept"]) == pytest.approx(0.5, abs=0.01) for r in snapkv)
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["tokens"] <= 512 for r in records)
    # Fidelity at every answer token: none for the full cache against itself, some for a cache half cut; the
    # expected answer's log-probability is a log-probability.
    assert all(r["answer_kl"] == 0 for r in records if r["method"] == "full")
    assert all(r["answer_kl"] > 0 for r in records if r["method"] == "snapkv")
    assert all(r["answer_logprob"] < 0 for r in records)
    for name in ("results.md", "summary.csv", "accuracy_vs_ratio.png", "niah_heatmap.png"):
        assert (out / name).stat().st_size > 0
    report = (out / "results.md").read_text()
    assert "question-agnostic" in report and "Machine:" in report and "Command: `kvcompile eval" in report
    rerun = next(line for line in report.splitlines() if line.startswith("Command: "))
    assert "--scoring" not in rerun  # the built-in suite's rerun command: --scoring is for a --suite
    assert "fidelity against each method's at each ratio" in report and "### log_answer_kl" in report

    # A finished run resumes without running anything; a new run into the same folder is refused.
    real_answer = suite_run.answer
    monkeypatch.setattr(suite_run, "answer", lambda *a, **k: pytest.fail("a finished prompt was run again"))
    assert runner.invoke(app, [*args, "--resume"]).exit_code == 0
    assert rows(out / "results.csv") == table
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "pass --resume to continue it" in refused.output

    # A method added to the finished run runs alone (plus the full cache's reference, whose logits are not stored).
    calls = []
    monkeypatch.setattr(suite_run, "answer", lambda *a, **k: calls.append(a[2].label) or real_answer(*a, **k))
    added = [*args[:2], "snapkv,kvcompose:unstructured=true,kvcompress", *args[3:], "--resume"]
    assert runner.invoke(app, added).exit_code == 0
    assert calls == ["full"] + ["full", "kvcompress"] * 2  # warm-up, then each prompt
    grown = rows(out / "results.csv")
    assert [r for r in grown if r["method"] != "kvcompress"] == table and len(grown) == len(table) + 2


def test_eval_in_batches_records_the_answers_of_one_prompt_at_a_time(tmp_path, default_model, monkeypatch):
    """`--batch-size 2`: kvcompile's methods answer two prompts at once; every record's answer, score and bytes
    held are those of the run one prompt at a time; the batched rows' peak memory is not claimed per prompt (one
    method and two prompts: the rows themselves are checked method by method in test_batches)."""
    monkeypatch.setattr("kvcompile.recipe.load_model", lambda model, **_: default_model)
    args = ["eval", "--methods", "distilled", "--tasks", "passkey", "--lengths", "512", "--samples", "2"]
    args += ["--ratios", "0.5", "--new-tokens", "16"]
    for out, batch in (("one", "1"), ("two", "2")):
        own = [*args, "--batch-size", batch, "--own-prefills", "--out", str(tmp_path / out)]  # peaks measured
        result = runner.invoke(app, own)
        assert result.exit_code == 0, result.output

    def records(out: str) -> dict:
        lines = (tmp_path / out / "runs.jsonl").read_text().splitlines()
        return {(r["prompt"], r["method"]): r for r in map(json.loads, lines)}

    alone, batched = records("one"), records("two")
    assert alone.keys() == batched.keys() and len(alone) == 4
    for key, record in alone.items():
        other = batched[key]
        for field in ("correct", "answer", "agreement", "cache_kept", "tokens"):
            assert other[field] == record[field], (key, field)
        assert other["kl"] == pytest.approx(record["kl"], abs=1e-3)
        assert other["answer_kl"] == pytest.approx(record["answer_kl"], abs=1e-3)
        assert other["answer_logprob"] == pytest.approx(record["answer_logprob"], abs=1e-2)
        assert (other["peak_mib"] is None) == (key[1] != "full")


def test_eval_on_one_shared_prefill_records_what_own_prefills_record(tmp_path, default_model, monkeypatch):
    """The default `--shared-prefill` against `--own-prefills` on the default model: a per-layer cut and a cut after
    the prefill give every record field but the prefill's timing and memory the same value, to rounding (a second
    pass too, on the tiny models of test_shared_prefill.py)."""
    monkeypatch.setattr("kvcompile.recipe.load_model", lambda model, **_: default_model)
    args = ["eval", "--methods", "distilled,compilerkv", "--tasks", "passkey"]
    args += ["--lengths", "512", "--samples", "1", "--ratios", "0.5,0.9", "--new-tokens", "8"]
    for out, way in (("own", "--own-prefills"), ("shared", "--shared-prefill")):
        result = runner.invoke(app, [*args, way, "--out", str(tmp_path / out)])
        assert result.exit_code == 0, result.output

    def records(out: str) -> dict:
        lines = (tmp_path / out / "runs.jsonl").read_text().splitlines()
        return {(r["prompt"], r["method"], r["ratio"]): r for r in map(json.loads, lines)}

    own, shared = records("own"), records("shared")
    assert own.keys() == shared.keys() and len(own) == 1 + 2 * 2
    timing = {"prefill_seconds", "prefill_vs_full", "peak_mib", "prefill"}
    for key, record in own.items():
        # the same computation in another order: floats equal to their last rounded digit
        assert {k: v for k, v in shared[key].items() if k not in timing} == pytest.approx(
            {k: v for k, v in record.items() if k not in timing}, abs=1e-4
        ), key
        assert record["prefill"] == "own" and record["peak_mib"] is not None
        assert shared[key]["prefill"] == "shared" and shared[key]["peak_mib"] is None
    assert "--shared-prefill" in (tmp_path / "shared" / "results.md").read_text()


def test_tune_writes_tuned_defaults_that_generate_applies(tmp_path, default_model, monkeypatch):
    monkeypatch.setattr("kvcompile.recipe.load_model", lambda model, **_: default_model)
    target = tmp_path / "tuned_defaults.safetensors"
    result = runner.invoke(
        app,
        [
            "tune",
            "--methods",
            "snapkv,compresskv",
            "--ratios",
            "0.5,0.75",
            "--tasks",
            "passkey",
            "--lengths",
            "1k",
            "--samples",
            "1",
            "--out",
            str(target),
        ],
    )
    assert result.exit_code == 0, result.output
    artifact = kvruntime.load_artifact(target, model=default_model[0], kind="tuned_defaults")
    assert not target.with_name("tuned_defaults.runs").exists() and target.with_suffix(".png").exists()
    assert read_run_record(target)["compile_seconds"] > 0  # the command's wall time, in the run record beside it
    recommended, tensors = artifact.params["recommended"], artifact.tensors
    assert tensors["full_accuracy"].tolist() == [1.0]  # on this prompt the full cache answers
    # The rule, applied here to the measured accuracies: each method's largest ratio before its accuracy first
    # falls out of the tolerance; the recommendation is the largest such ratio, then accuracy, then the lower KL.
    ratios, accuracy, kl = tensors["ratios"].tolist(), tensors["accuracy"].tolist(), tensors["kl"].tolist()
    lowest = tensors["full_accuracy"].item() - artifact.params["tolerance"] - 1e-9
    chosen = []
    for curve in accuracy:
        passing = [r for r, _ in itertools.takewhile(lambda pair: pair[1] >= lowest, zip(ratios, curve))]
        chosen.append(passing[-1] if passing else None)
    assert tensors["chosen_ratio"].tolist() == [-1.0 if c is None else c for c in chosen]
    rank = {
        m: (c, accuracy[m][ratios.index(c)], -kl[m][ratios.index(c)]) for m, c in enumerate(chosen) if c is not None
    }
    assert rank, "no method stayed within the tolerance at 0.5: the prompt no longer tells the methods apart"
    best = max(rank, key=rank.get)
    label = ["snapkv", "compresskv"][best]
    assert (recommended["label"], recommended["ratio"]) == (label, chosen[best])
    assert f"recommended: {label} at ratio {chosen[best]:g}" in result.output
    # The artifacts of the recommended method (the shipped ones) are copied beside it: the runtime reads them there.
    assert bool(recommended["artifacts"]) == (label == "compresskv")
    for name in recommended["artifacts"]:
        assert (tmp_path / name).read_bytes() == (artifact_folder("default") / name).read_bytes()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text((Path(__file__).parents[1] / "calibration_data/prompts/passkey_2k.txt").read_text())
    generated = runner.invoke(
        app, ["generate", "--prompt-file", str(prompt), "--artifact", str(target), "--max-new-tokens", "8"]
    )
    assert generated.exit_code == 0, generated.output
    assert recommended["method"] in generated.output
    assert f"entries removed     {100 * chosen[best]:.1f}%" in generated.output


def test_eval_runs_a_user_s_own_suite_on_the_default_model(tmp_path, default_model, monkeypatch):
    """`--suite`: a user's JSON Lines prompts through the same runs and records as the built-in suite's, scored by
    token F1; the full cache finds the facts the lines ask for."""
    monkeypatch.setattr("kvcompile.recipe.load_model", lambda model, **_: default_model)
    from kvcompile.tasks.passkey import FILLER, INTRO

    filler = FILLER * 12
    rows = [
        {"id": "key", "context": INTRO + filler + "The pass key is 71432. Remember it. 71432 is the pass key. " + filler,
         "question": "What is the pass key?", "answers": ["71432"], "answer_prefix": " The pass key is"},
        {"id": "city", "context": filler + "Mara moved to the city of Lisbon last spring. " + filler,
         "question": "Which city did Mara move to?", "answers": ["Lisbon"], "answer_prefix": " Mara moved to"},
    ]  # fmt: skip
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "eval"
    args = ["eval", "--suite", str(tmp_path / "mine.jsonl"), "--scoring", "f1", "--methods", "snapkv"]
    result = runner.invoke(app, [*args, "--ratios", "0.5", "--new-tokens", "12", "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = {(r["id"], r["method"]): r for r in map(json.loads, (out / "runs.jsonl").read_text().splitlines())}
    assert set(records) == {(i, m) for i in ("key", "city") for m in ("full", "snapkv")}
    # Token F1 by hand: "71432. Remember it. The pass" is 4 normalised words (the article dropped), 1 of them the
    # answer: precision 1/4, recall 1 -> 0.4; "the city of Lisbon last spring." is 5, 1 the answer -> 1/3.
    assert records["key", "full"]["answer"].startswith("71432") and records["key", "full"]["correct"] == 0.4
    assert records["city", "full"]["answer"].startswith("the city of Lisbon")
    assert records["city", "full"]["correct"] == pytest.approx(1 / 3, abs=1e-4)
    assert all(r["task"] == "mine" and r["length"] == 1024 and r["answer_logprob"] < 0 for r in records.values())
    assert records["key", "snapkv"]["cache_kept"] == pytest.approx(0.5, abs=0.02)
    assert "2 prompts of the suite mine" in (out / "results.md").read_text()
